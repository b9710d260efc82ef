"""The source of a conversion or an export: a P2R checkpoint folder's config.json, read as JSON and checked by the
model's own validators, and its weights (the safetensors headers), checked against what that config describes.
Plain Python, no torch or transformers (`read_p2r_config` imports transformers when called; `source_tensor` reads
through a `CheckpointReader`, torch's).

config.json and the weights are input hf-p2r did not write: they are read within the folder only (`io.file_within`),
their sizes bounded by the model's own validators and checked against the headers before any list grows with them,
and every problem is one `InputError` line naming the file (`hf_p2r.errors`).

A MoE checkpoint holds its experts as transformers writes Mixtral's (`save_pretrained` reverses the load-time merge of
the 3-D expert parameters); a source holding the in-memory 3-D experts is read as that layout (`split_experts`: each
expert's projections are byte ranges of the 3-D tensors).
"""

import os
import re
import types
from pathlib import Path

from ..errors import InputError, printable
from ..models.p2r.inventory_p2r import DEPTH_DEFAULT, LAYOUT_DEFAULTS, MOE_DEFAULTS, SHAPE_DEFAULTS, inventory
from ..models.p2r.sharing_p2r import LAYER_KEY, validate_layout, validate_moe
from .headers import FLOAT_CODES, NAME_LIMIT, TensorInfo
from .io import CONFIG_NAME, read_config_dict


def read_p2r_config_dict(folder: str | os.PathLike) -> dict:
    """The config.json of a P2R checkpoint folder (dense or MoE) as a dict, with the fields the weights depend on
    checked by the model's own validators (`validate_layout`, `validate_moe`: types, sizes and their bounds, sharing),
    and the sharing and MoE fields filled in as `P2RConfig` / `P2RMoeConfig` fill them: errors name the file and the
    problem (`InputError`). No transformers. A config.json this accepts loads with `read_p2r_config`."""
    config = read_config_dict(folder)
    path = Path(folder) / CONFIG_NAME
    if config.get("model_type") not in ("p2r", "p2r_moe"):
        raise InputError(
            f"{path}: model_type is {_short(config.get('model_type'))}, not 'p2r' or 'p2r_moe': not a P2R checkpoint"
        )
    fields = {**SHAPE_DEFAULTS, **LAYOUT_DEFAULTS, **config}
    fields = {**fields, "num_hidden_layers": config.get("num_hidden_layers", DEPTH_DEFAULT)}
    moe = {}
    if config["model_type"] == "p2r_moe":
        moe = {field: config.get(field, default) for field, default in MOE_DEFAULTS.items()}
        if moe["moe_intermediate_size"] is None:
            moe["moe_intermediate_size"] = fields["intermediate_size"]
        if moe["mlp_only_layers"] is None:
            moe["mlp_only_layers"] = []
    layout = types.SimpleNamespace(**{**fields, **moe})
    try:
        validate_layout(layout)
        if moe:
            validate_moe(layout)
    except ValueError as error:
        raise InputError(f"{path}: {cut_text(str(error))}") from None
    return {
        **config,
        **moe,
        "num_hidden_layers": layout.num_hidden_layers,
        "share_layers": layout.share_layers,
        "num_unique_layers": layout.num_unique_layers,
        "sharing_pattern": layout.sharing_pattern,
        **({"real_num_hidden_layers": layout.real_num_hidden_layers} if "real_num_hidden_layers" in config else {}),
    }


def _short(value, limit: int = 120) -> str:
    """repr(value), cut to `limit` characters (a message quotes a value, not megabytes of it)."""
    return cut_text(repr(value), limit)


def cut_text(text: str, limit: int = 400) -> str:
    """`text`, cut to `limit` characters (ending in "...") where longer: a message quotes an error, not megabytes."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def read_p2r_config(folder: str | os.PathLike):
    """The `P2RConfig` (`P2RMoeConfig` for a MoE checkpoint) of a checkpoint folder, with errors that name the file and
    the problem."""
    from huggingface_hub.errors import StrictDataclassError

    from ..models.p2r import P2RConfig, P2RMoeConfig

    config = read_p2r_config_dict(folder)  # the same checks, and messages, as the converter's
    config_class = P2RMoeConfig if config["model_type"] == "p2r_moe" else P2RConfig
    try:
        return config_class.from_dict(read_config_dict(folder))
    except (ValueError, TypeError, StrictDataclassError) as error:
        # huggingface_hub's validation errors span two lines ("Validation error for field ...:\n    TypeError: ...")
        lines = " ".join(line.strip() for line in str(error).splitlines())
        raise ValueError(f"{Path(folder) / CONFIG_NAME}: {lines}") from None


def parameter_shapes(config: dict, num_blocks: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a P2R (or Llama, or Mixtral) checkpoint of `config` with `num_blocks` layer blocks
    stores, in the order `save_pretrained` writes them, tied aliases left out: the model's inventory on disk
    (`inventory_p2r.Inventory.disk_shapes`). Plain Python: tests/checkpoint/test_ranges.py (dense) and
    test_convert_moe.py (MoE) check it against the model built on the meta device."""
    return inventory(config, num_blocks).disk_shapes()


def tensor_count(config: dict, num_blocks: int) -> int:
    """len(parameter_shapes(config, num_blocks)), counted without building it (`Inventory.disk_count`: one pass over
    the blocks, experts counted, not listed), so that a size can be checked before work grows with it."""
    return inventory(config, num_blocks).disk_count


def check_blocks(src: Path, weights: dict[str, TensorInfo], config: dict) -> None:
    """The stored layer blocks must be those `config` describes: 0..k-1 (pseudo) or 0..L-1 (real)."""
    config_path = src / CONFIG_NAME
    share = config["share_layers"]
    num_blocks = config["num_unique_layers"] if share else config["num_hidden_layers"]
    blocks = sorted({int(match["block"]) for name in weights if (match := LAYER_KEY.match(name))})
    if blocks != list(range(num_blocks)):
        shown = f"blocks {blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else f"block {blocks}" if blocks else "none"
        raise InputError(
            f"{src}: the weights hold {len(blocks)} layer blocks ({shown}) but {config_path} describes a "
            f"{'pseudo' if share else 'real'} model with {num_blocks} (share_layers={share}, "
            f"num_unique_layers={config['num_unique_layers']}, num_hidden_layers={config['num_hidden_layers']})"
        )


def check_weights(src: Path, weights: dict[str, TensorInfo], config: dict, expected: dict) -> str:
    """The stored tensors must be exactly those of the model `config` describes, all of one floating-point dtype
    (returned, as a name: "bfloat16"). A header that relabels a tensor's dtype with one of the same size (F32 as I32,
    BF16 as F16) is not caught by safetensors: the dtype checks are what catch it."""
    config_path = src / CONFIG_NAME
    if missing := sorted(expected.keys() - weights.keys()):
        raise InputError(f"{src}: missing tensors that {config_path} requires: {', '.join(missing[:3])}")
    if extra := sorted(weights.keys() - expected.keys()):
        raise ValueError(
            f"{weights[extra[0]].file}: holds tensors that the model of {config_path} does not have: "
            + ", ".join(printable(name, NAME_LIMIT) for name in extra[:3])
        )
    by_dtype: dict[str, list[str]] = {}
    for name, shape in expected.items():
        info = weights[name]
        if info.shape != shape:
            raise ValueError(
                f"{info.file}: {name} has shape {list(info.shape)} but {config_path} implies {list(shape)}"
            )
        if info.dtype not in FLOAT_CODES:
            raise ValueError(
                f"{info.file}: {name} is stored as {info.dtype_name}, but model weights are floating point (a header "
                "with the wrong dtype?)"
            )
        by_dtype.setdefault(info.dtype_name, []).append(name)
    if len(by_dtype) > 1:
        (common, names), *others = sorted(by_dtype.items(), key=lambda item: -len(item[1]))
        odd_dtype, odd_names = others[0]
        raise ValueError(
            f"{weights[odd_names[0]].file}: {odd_names[0]} is stored as {odd_dtype}, but {len(names)} other tensors "
            f"(e.g. {names[0]}) are {common}: a checkpoint's weights share one dtype (a header with the wrong dtype?)"
        )
    return next(iter(by_dtype))


# A sparse layer's tensors as the model holds them in memory (3-D experts), which from_pretrained also loads.
_FUSED_EXPERTS = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+\.)mlp\.(?P<rest>experts\.gate_up_proj|experts\.down_proj|gate\.weight)$"
)


def split_experts(
    src: Path, weights: dict[str, TensorInfo], config: dict
) -> tuple[dict[str, TensorInfo], dict[str, tuple]]:
    """A MoE checkpoint whose sparse layers hold the in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`; from_pretrained loads it too) seen as the layout
    `save_pretrained` writes: one tensor per expert and projection under Mixtral's names. Every expert's w1, w3
    (the two halves of its `gate_up_proj` rows) and w2 (its `down_proj`) are contiguous byte ranges of the 3-D tensor,
    so they are copied like any tensor, without torch. Returns the tensors, and {new name: (stored name, index)} of
    those that are views, for the torch paths (cast, verify). Other checkpoints are returned as they are."""
    if config["model_type"] != "p2r_moe" or not any(_FUSED_EXPERTS.match(name) for name in weights):
        return weights, {}
    moe = {field: config.get(field, default) for field, default in MOE_DEFAULTS.items()}
    experts, hidden, size = moe["num_experts"], config.get("hidden_size", 4096), moe["moe_intermediate_size"]
    shapes = {"experts.gate_up_proj": (experts, 2 * size, hidden), "experts.down_proj": (experts, hidden, size)}
    out, views = {}, {}
    for name, info in weights.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = info
            continue
        moe_prefix = f"{match['layer']}block_sparse_moe."
        if match["rest"] == "gate.weight":
            out[f"{moe_prefix}gate.weight"], views[f"{moe_prefix}gate.weight"] = info, (name, ())
            continue
        if info.shape != shapes[match["rest"]]:
            raise ValueError(
                f"{info.file}: {name} has shape {list(info.shape)} but {src / CONFIG_NAME} implies "
                f"{list(shapes[match['rest']])}"
            )
        item = info.nbytes // info.numel  # bytes per element
        parts = {"w1": slice(0, size), "w3": slice(size, 2 * size)} if "gate_up" in name else {"w2": None}
        for expert in range(experts):
            start = info.offset + expert * info.nbytes // experts
            for part, rows in parts.items():
                offset = start + (rows.start * hidden * item if rows else 0)
                shape = (size, hidden) if rows else (hidden, size)
                new = f"{moe_prefix}experts.{expert}.{part}.weight"
                out[new] = TensorInfo(info.file, info.dtype, shape, offset, size * hidden * item)
                views[new] = (name, (expert, rows) if rows else (expert,))
    return out, views


def source_tensor(reader, name: str, views: dict, zero: bool = False):
    """The source tensor of `name`: stored under that name, or a view of a stored 3-D expert (`split_experts`); with
    `zero`, zeros of its shape and dtype (one element, expanded: no memory)."""
    tensor = reader.get(name) if name not in views else reader.get(views[name][0])[views[name][1]]
    return tensor.new_zeros(()).expand(tensor.shape) if zero else tensor
