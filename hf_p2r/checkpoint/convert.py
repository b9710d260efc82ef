"""Pseudo -> real conversion on disk: every depth gets its own copy of its block's weights, streamed.

The conversion is planned from config.json (read as JSON) and the safetensors headers, without torch or
transformers, for dense (`p2r`) and mixture-of-experts (`p2r_moe`) checkpoints alike: which block each new block
copies comes from `delink_names`, the function the model's own `delink_parameter_map` uses, so a converted checkpoint
and `model.delink()` agree by construction. The output shards are then written by the kernel, header + byte ranges of
the source (`ranges.py`). Only a dtype cast, which changes the bytes, goes through torch (`writer.py`: the source
memory-mapped, cast tensor by tensor), and `verify` reopens the output with torch. The same engine exports a real
checkpoint to vanilla Llama or Mixtral (only config.json changes).

config.json and the weights are input hf-p2r did not write: they are read within the folder only (`io.file_within`),
their sizes bounded by the model's own validators and checked against the headers before any list grows with them,
and every problem is one `InputError` line naming the file (`hf_p2r.errors`).

A MoE checkpoint holds its experts as transformers writes Mixtral's (`save_pretrained` reverses the load-time merge of
the 3-D expert parameters): `block_sparse_moe.experts.<e>.w1/w2/w3.weight` and `block_sparse_moe.gate.weight` per
sparse layer, so its layers are copied like any other tensors, and the same files are a Mixtral checkpoint once
config.json says so (`target="mixtral"`). A source holding the in-memory 3-D experts is read as that layout
(`split_experts`: each expert's projections are byte ranges of the 3-D tensors).
"""

import copy
import fnmatch
import importlib.metadata
import json
import logging
import os
import re
import shutil
import types
from collections.abc import Iterable
from pathlib import Path

from ..errors import InputError, printable, redact
from ..models.p2r.inventory_p2r import DEPTH_DEFAULT, LAYOUT_DEFAULTS, MOE_DEFAULTS, SHAPE_DEFAULTS, inventory
from ..models.p2r.sharing_p2r import (
    LAYER_KEY,
    RESIDUAL_OUTPUT,
    DelinkPlan,
    delink_names,
    delink_sources,
    plan_delink,
    reachable_block_counts,
    validate_layout,
    validate_moe,
)
from .headers import FLOAT_CODES, NAME_LIMIT, TensorInfo, parse_size, read_weights
from .io import CONFIG_NAME, atomic_directory, files_within, read_config_dict, resolve_destination, why_skipped
from .ranges import copying
from .targets import get_target

logger = logging.getLogger(__name__)

# Files other than weights and config.json that travel with a checkpoint (tokenizer and generation settings).
CARRIED_FILES = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
)
# Folders that travel with it: transformers' named chat templates (additional_chat_templates/<name>.jinja).
CARRIED_FOLDERS = ("additional_chat_templates",)
# The rest of a model folder hf-p2r writes (`check_output_folder`: what --overwrite may replace): config, card,
# weights (one file, or shards and their index), model code.
MODEL_FOLDER_FILES = (CONFIG_NAME, "README.md", "model*.safetensors", "model.safetensors.index.json", "*.py")
# What shows a folder holds a training run (`hf_p2r.training`: output_dir, a checkpoint folder): never replaced.
TRAINING_RUN_FILES = ("checkpoints", "trainer_state.json", ".metadata", "metrics.jsonl", "train_config.yaml")
# dtypes an output can be cast to: those transformers loads without a quantization config.
DTYPES = ("float32", "float16", "bfloat16", "float64")
# The most tensors an output may hold: far above any model's (DeepSeek-V3: ~92,000), far below what would exhaust
# memory while it is planned.
MAX_TENSORS = 2_000_000


def convert_pseudo_to_real(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    num_unique_layers: int | None = None,
    num_hidden_layers: int | None = None,
    growth: str = "stack",
    function_preserving: bool = False,
    max_shard_size: int | str = "5GB",
    dtype=None,
    target: str = "p2r",
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the pseudo checkpoint folder `src` into a real one in `dst` (or, with `num_unique_layers=k'`, into a
    pseudo one with more blocks); returns `dst`.

    The output loads with `from_pretrained` and equals the delinked model tensor for tensor: as `P2RForCausalLM` or
    `P2RMoeForCausalLM` (`target="p2r"`, config with `share_layers=False`), as a vanilla `LlamaForCausalLM`
    (`target="llama"`, dense, real only), or as a vanilla `MixtralForCausalLM` (`target="mixtral"`, MoE, real only;
    models without a Mixtral equivalent, such as expert prototyping, are refused). Weights are streamed: each output
    shard (at most `max_shard_size`, e.g. "5GB" or a number of bytes) is the header safetensors would write followed by
    byte ranges of the source, copied by the kernel (`copy_file_range`, reflinks where the filesystem has them), so
    anonymous memory stays constant whatever the model size and the files are byte for byte what safetensors writes.
    `dtype` (float32, float16, bfloat16 or float64, a name or a `torch.dtype`) casts the weights, through torch.
    generation_config.json, tokenizer files and named chat templates (and, for `target="p2r"` from a source with remote
    code, the model code) are carried over, and README.md is a model card recording where the checkpoint came from.

    A real source (`share_layers: false`) is exported: `target="llama"` / `"mixtral"` rewrite config.json (and, for
    Mixtral, nothing else: the weights already have Mixtral's names), `target="p2r"` only casts it (with `dtype`; there
    is nothing to delink). `num_unique_layers` equal to the source's block count delinks nothing: the output is the
    source, re-sharded or cast, and a warning says so. Other counts must keep the function (`reachable_block_counts`):
    the message lists those that do.

    `num_hidden_layers=L'` grows a checkpoint of depth d (a shallow one, or any) to L' layers, a delink along the
    depths (`P2RPreTrainedModel.delink`, `sharing_p2r.plan_delink`): new layer i copies layer i mod d (`growth="stack"`)
    or floor(i d / L') (`"interleave"`), byte for byte, into one block per layer unless `num_unique_layers` says fewer.
    `function_preserving=True` writes zeros for the residual outputs (o_proj, down_proj) of the later copies of each
    layer, so the output computes the source's function; a Depth-µP source (`depth_mup`) is refused there (its kept
    outputs would need rescaling: grow it with `from_pretrained(..., function_preserving=True)` instead).

    `src` is only read, and only files within it (a Hub cache snapshot's links into its blobs included): a carried file
    that is a link out of `src`, a FIFO or a device is skipped with a warning naming it; weights or a config.json that
    lie outside `src` refuse the conversion. Sizes in config.json are bounded and checked against the safetensors
    headers before anything grows with them. The output is built in a temporary folder beside `dst` and renamed into
    place at the end: on any error (bad input, disk full, Ctrl-C, SIGTERM) `dst` is left as it was, and every long
    phase (copies, casts, verification) stops within a second of a signal. A non-empty `dst` is refused unless
    `overwrite`, also when another process filled it while this one ran; a `dst` that is a link is written through
    (its target is replaced).
    `verify=True` reopens the output before the rename and checks names, shapes, dtypes and every byte against the
    source; the warnings and the verification's summary are logged (`logging`, logger `hf_p2r.checkpoint.convert`),
    which `hf-p2r convert` prints.

    ```python
    >>> convert_pseudo_to_real("pseudo_1x24", "real_24", dtype="bfloat16")
    >>> convert_pseudo_to_real("pseudo_1x24", "pseudo_4x24", num_unique_layers=4)   # partial: 1 -> 4 blocks
    >>> convert_pseudo_to_real("real_24", "llama_24", target="llama")              # a real P2R folder -> Llama
    >>> convert_pseudo_to_real("shallow_2", "grown_8", num_hidden_layers=8, function_preserving=True)   # growth
    ```
    """
    max_shard_size, dtype = parse_size(max_shard_size), parse_dtype(dtype)  # before reading anything
    get_target(target)
    src = Path(src)
    config = read_p2r_config_dict(src)
    plan = None
    if num_hidden_layers is not None and num_hidden_layers != config["num_hidden_layers"]:
        plan = conversion_growth(
            config,
            src,
            num_unique_layers=num_unique_layers,
            num_hidden_layers=num_hidden_layers,
            growth=growth,
            function_preserving=function_preserving,
            target=target,
        )
        blocks = plan.num_unique_layers
    elif function_preserving:
        raise InputError(f"function_preserving: nothing grows (num_hidden_layers is {src}'s own)")
    else:
        blocks = conversion_blocks(
            config, src, src / CONFIG_NAME, num_unique_layers=num_unique_layers, target=target, dtype=dtype
        )
    return rewrite_checkpoint(
        src,
        dst,
        config,
        num_blocks=blocks,
        plan=plan,
        target=target,
        max_shard_size=max_shard_size,
        dtype=dtype,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
    )


def conversion_blocks(
    config: dict, src: Path, config_path: Path, *, num_unique_layers: int | None, target: str, dtype: str | None
) -> int:
    """The blocks of the output of converting the checkpoint `src` (config dict `config`, as `read_p2r_config_dict`
    gives it, read from `config_path`) to `target` with `num_unique_layers` and `dtype` (parsed): `InputError` naming
    them for a conversion the converter refuses (nothing to do, a count that does not keep every depth's block, a model
    the target cannot write), before anything is read or written."""
    spec = get_target(target)
    if num_unique_layers is not None and (
        isinstance(num_unique_layers, bool) or not isinstance(num_unique_layers, int)
    ):
        raise InputError(f"num_unique_layers must be an integer, got {num_unique_layers!r}")
    depth, stored = config["num_hidden_layers"], config["num_unique_layers"]
    if config.get("real_num_hidden_layers") and not config["share_layers"] and not spec.real_only and dtype is None:
        raise InputError(
            f"{config_path}: {src} is a shallow checkpoint with a block per layer ({depth} of the real model's "
            f"{config['real_num_hidden_layers']}): there is nothing to delink at its depth; grow it with "
            f"num_hidden_layers (--num-hidden-layers {config['real_num_hidden_layers']})"
        )
    if not config["share_layers"] and not spec.real_only and dtype is None:
        raise InputError(
            f"{config_path}: share_layers is false: {src} is already a real checkpoint, there is nothing to "
            "delink; export it with target='llama' or 'mixtral' (--target), or cast it with dtype (--dtype)"
        )
    blocks = depth if num_unique_layers is None else num_unique_layers
    if spec.real_only and blocks != depth:
        raise InputError(
            f"target={target!r} needs the real model (one block per layer): num_unique_layers={num_unique_layers} is "
            f"not num_hidden_layers ({depth})"
        )
    if blocks != stored:
        pattern = config["sharing_pattern"]
        reachable = [stored, *reachable_block_counts(depth, stored, pattern)] if config["share_layers"] else [depth]
        if blocks not in reachable:
            shown = [f"{stored} (nothing to delink: a copy)", *map(str, reachable[1:])]
            if len(shown) > 8:
                shown = [*shown[:6], "...", shown[-1]]
            raise InputError(
                f"{src}: num_unique_layers={blocks} cannot be reached from {stored} blocks (sharing_pattern="
                f"{pattern!r}, {depth} layers): every depth must keep the block it ran; it can be {', '.join(shown)}"
            )
    spec.check(config, config_path)
    return blocks


def conversion_growth(
    config: dict,
    src: Path,
    *,
    num_unique_layers: int | None,
    num_hidden_layers: int,
    growth: str,
    function_preserving: bool,
    target: str,
) -> DelinkPlan:
    """The `DelinkPlan` of growing the checkpoint `src` (config dict `config`, from `read_p2r_config_dict`) to
    `num_hidden_layers` layers: `InputError` naming them for a growth the converter refuses, before anything is read
    or written."""
    spec, config_path = get_target(target), src / CONFIG_NAME
    try:
        plan = plan_delink(
            config,
            num_unique_layers,
            num_hidden_layers=num_hidden_layers,
            growth=growth,
            function_preserving=function_preserving,
        )
    except ValueError as error:
        raise InputError(f"{src}: {_cut(str(error))}") from None
    if plan.output_scale != 1.0:
        raise InputError(
            f"{config_path}: depth_mup is true, and function-preserving growth rescales the kept layers' outputs "
            "(a cast the streamed converter does not make): load it with from_pretrained(..., num_hidden_layers="
            f"{num_hidden_layers}, growth={growth!r}, function_preserving=True) and save the result"
        )
    if spec.real_only and plan.num_unique_layers != num_hidden_layers:
        raise InputError(
            f"target={target!r} needs the real model (one block per layer): num_unique_layers={num_unique_layers} is "
            f"not num_hidden_layers ({num_hidden_layers})"
        )
    spec.check({**config, **plan.fields}, config_path)
    return plan


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
        raise InputError(f"{path}: {_cut(str(error))}") from None
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
    return _cut(repr(value), limit)


def _cut(text: str, limit: int = 400) -> str:
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


def rewrite_checkpoint(
    src: Path,
    dst: str | os.PathLike,
    config: dict,
    *,
    num_blocks: int,
    plan: DelinkPlan | None = None,
    target: str,
    max_shard_size: int,
    dtype: str | None,
    overwrite: bool,
    verify: bool,
    progress: bool,
) -> Path:
    """Stream the checkpoint in `src` (whose config.json is `config`, from `read_p2r_config_dict`) into `dst` with
    `num_blocks` blocks (the shared engine of `convert_pseudo_to_real` and `export_llama`; `max_shard_size` and `dtype`
    already parsed; `target` checked by its `Target.check`), grown as `plan` says (`conversion_growth`) if given."""
    dst = Path(dst)
    check_output_folder(dst, [src], overwrite=overwrite)
    stored_blocks = config["num_unique_layers"] if config["share_layers"] else config["num_hidden_layers"]
    if (count := tensor_count(config, num_blocks)) > MAX_TENSORS:  # before any list grows with it
        raise InputError(
            f"{src / CONFIG_NAME}: the output would hold {count} tensors ({num_blocks} blocks), more than any model "
            f"has (at most {MAX_TENSORS})"
        )
    weights, views = split_experts(src, read_weights(src), config)
    _check_blocks(src, weights, config)
    if (count := tensor_count(config, stored_blocks)) > 2 * len(weights) + 100:  # the truth on disk bounds the plan
        raise InputError(
            f"{src}: {src / CONFIG_NAME} describes a model of {count} tensors but the weights hold {len(weights)}"
        )
    expected = parameter_shapes(config, stored_blocks)
    out_config = config if plan is None else {**config, **plan.fields}  # the model written
    # new name -> source name: the delink map of the model, so conversion and delink() agree by construction
    if plan is not None:
        new_to_old = delink_names(expected, list(plan.sources))
    elif num_blocks == stored_blocks:
        new_to_old = {name: name for name in expected}
    else:
        try:
            sources = delink_sources(config["num_hidden_layers"], stored_blocks, num_blocks, config["sharing_pattern"])
        except ValueError as error:
            raise InputError(f"{src}: {error}") from None
        new_to_old = delink_names(expected, sources)
    order = parameter_shapes(out_config, num_blocks)  # the order transformers itself saves in
    fresh = () if plan is None else plan.fresh
    zeroed = {
        name
        for name in order
        if (m := LAYER_KEY.match(name)) and int(m["block"]) in fresh and RESIDUAL_OUTPUT.match(m["rest"])
    }

    source_dtype = _check_weights(src, weights, config, expected)  # before any output exists
    out_dtype = dtype or source_dtype
    if num_blocks == stored_blocks and plan is None and not get_target(target).real_only:
        change = "a copy" if out_dtype == source_dtype else f"cast from {source_dtype} to {out_dtype}"
        logger.warning(f"nothing to delink: {src} already has {stored_blocks} blocks; {dst} is {change}")
    tensors = {new: weights[new_to_old[new]] for new in order}
    provenance = {
        "source": src.resolve().name,
        "source_kind": "pseudo" if config["share_layers"] else "real",
        "source_num_unique_layers": stored_blocks,
        "num_hidden_layers": out_config["num_hidden_layers"],
        "num_unique_layers": num_blocks,
        "sharing_pattern": config["sharing_pattern"],
        **(
            {}
            if plan is None
            else {"source_num_hidden_layers": config["num_hidden_layers"], "growth": growth_note(plan, zeroed)}
        ),
        "dtype": f"{out_dtype} (unchanged)" if out_dtype == source_dtype else f"{out_dtype} (cast from {source_dtype})",
        "target": target,
        "converted_with": f"hf-p2r {_version('hf-p2r')}",
    }
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        if (
            out_dtype == source_dtype and not zeroed
        ):  # bytes as they are: copied by the kernel while the rest is written
            with copying(tmp, tensors, max_shard_size=max_shard_size, progress=progress):
                _write_the_rest(src, tmp, out_config, num_blocks, target, out_dtype, dst.name, provenance)
        else:
            _write_cast(tmp, src, new_to_old, views, order, out_dtype, max_shard_size, progress, zeroed)
            _write_the_rest(src, tmp, out_config, num_blocks, target, out_dtype, dst.name, provenance)
        if verify:
            files = _verify_against_source(tmp, src, new_to_old, views, out_dtype, zeroed)
            cast = "" if out_dtype == source_dtype else f" cast to {out_dtype}"
            layers = (
                f"each of the {num_blocks} blocks is the block its depths ran in {src} ({stored_blocks} blocks)"
                if num_blocks != stored_blocks
                else f"the same {stored_blocks} blocks as {src}"
            )
            zeros = f" ({len(zeroed)} new residual outputs all zeros)" if zeroed else ""
            logger.info(
                f"verified {len(new_to_old)} tensors in {files} file{'s' * (files > 1)} before the rename: names, "
                f"shapes and dtypes as planned, every byte equal to its source tensor's{cast}{zeros}; {layers}"
            )
    return dst


def tensor_count(config: dict, num_blocks: int) -> int:
    """len(parameter_shapes(config, num_blocks)), counted without building it (`Inventory.disk_count`: one pass over
    the blocks, experts counted, not listed), so that a size can be checked before work grows with it."""
    return inventory(config, num_blocks).disk_count


def growth_note(plan: DelinkPlan, zeroed: set) -> str:
    """How a grown checkpoint's new layers started, for its model card."""
    zeros = f"; {len(zeroed)} residual outputs of the later copies zeroed (function-preserving)" if zeroed else ""
    return f"each new block copies block {list(plan.sources)} of the source{zeros}"


def _write_the_rest(src, tmp, config, num_blocks, target, dtype, model_id, provenance) -> None:
    """Everything but the weights: config.json, the files that travel with a checkpoint, the model card."""
    from .card import render_model_card  # huggingface_hub's model cards (0.3 s of imports: while the kernel copies)

    out_config = output_config(config, num_blocks, target=target, dtype=dtype)
    (tmp / CONFIG_NAME).write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
    _carry_files(src, tmp, remote_code=get_target(target).carries_code and "auto_map" in out_config)
    card = redact(str(render_model_card(tmp, model_id=model_id, provenance=provenance)))  # (no token in any output)
    (tmp / "README.md").write_text(card, encoding="utf-8", newline="")  # (what ModelCard.save writes)


def output_config(config: dict, num_blocks: int, *, target: str, dtype: str) -> dict:
    """The config.json of the output: the source's with the sharing fields (and `dtype`) of `num_blocks` blocks, as
    the conversion `target` writes it (`Target.fields`, and the `model_type` it writes: Llama's fields without P2R's,
    or Mixtral's). Written as transformers writes a config (sorted keys, indent 2), so a source saved by transformers
    gives the file `save_pretrained` would write (a test checks it)."""
    spec = get_target(target)
    out = copy.deepcopy(config)
    out.pop("torch_dtype", None)  # the old name of `dtype`
    out.update(share_layers=num_blocks < config["num_hidden_layers"], num_unique_layers=num_blocks, dtype=dtype)
    version = _version("transformers") or out.get("transformers_version")
    return {**spec.fields(out), "model_type": spec.writes[config["model_type"]], "transformers_version": version}


def _version(package: str) -> str | None:
    """The installed version of `package` (its distribution's metadata), None if it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_cast(
    tmp: Path,
    src: Path,
    new_to_old: dict,
    views: dict,
    order: dict,
    dtype: str,
    max_shard_size: int,
    progress: bool,
    zeroed: set = frozenset(),
):
    """The weights cast to `dtype`, the `zeroed` ones zeros: torch's path (the source memory-mapped, each tensor cast
    into a file-backed scratch mapping on its way to safetensors)."""
    import torch

    from .reader import CheckpointReader
    from .writer import write_checkpoint

    with CheckpointReader(src) as reader:
        tensors = {new: _source_tensor(reader, new_to_old[new], views, new in zeroed) for new in order}
        write_checkpoint(tmp, tensors, max_shard_size=max_shard_size, dtype=getattr(torch, dtype), progress=progress)


def _verify_against_source(
    tmp: Path, src: Path, new_to_old: dict, views: dict, dtype: str, zeroed: set = frozenset()
) -> int:
    import torch

    from .reader import CheckpointReader

    with CheckpointReader(src) as reader:
        expected = {
            new: (_source_tensor(reader, old, views, new in zeroed), getattr(torch, dtype))
            for new, old in new_to_old.items()
        }
        return verify_checkpoint(tmp, expected)


def _source_tensor(reader, name: str, views: dict, zero: bool = False):
    """The source tensor of `name`: stored under that name, or a view of a stored 3-D expert (`split_experts`); with
    `zero`, zeros of its shape and dtype (one element, expanded: no memory)."""
    tensor = reader.get(name) if name not in views else reader.get(views[name][0])[views[name][1]]
    return tensor.new_zeros(()).expand(tensor.shape) if zero else tensor


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


def verify_checkpoint(folder: str | os.PathLike, expected: dict) -> int:
    """Check that the weights in `folder` are exactly `expected` ({name: (source tensor, torch dtype)}): same names,
    shapes and dtypes, and every byte equal to the source cast to that dtype; returns the number of files checked.
    Raises `ValueError` on the first difference. Compares in chunks, so memory stays small (and Ctrl-C acts between
    two of them)."""
    import torch

    from .reader import CheckpointReader

    with CheckpointReader(folder) as out:
        names = set(out.keys())
        if names != expected.keys():
            missing, extra = sorted(expected.keys() - names), sorted(names - expected.keys())
            raise ValueError(f"{folder}: verify failed: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, (source, dtype) in expected.items():
            tensor = out.get(name)
            if tensor.shape != source.shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{out.file_of(name)}: verify failed: {name} is {tensor.dtype} {list(tensor.shape)}, expected "
                    f"{dtype} {list(source.shape)}"
                )
            flat, flat_source = tensor.reshape(-1), source.reshape(-1)
            step = 1 << 22
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                source_chunk = flat_source[start : start + step].to(dtype).contiguous()  # (zeros are expanded)
                # bytes, not values: NaNs compare equal to themselves, -0.0 differs from 0.0
                if not torch.equal(chunk.view(torch.uint8), source_chunk.view(torch.uint8)):
                    raise ValueError(f"{out.file_of(name)}: verify failed: {name} differs from its source")
        return len(out.files)


def _check_blocks(src: Path, weights: dict[str, TensorInfo], config: dict) -> None:
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


def _check_weights(src: Path, weights: dict[str, TensorInfo], config: dict, expected: dict) -> str:
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


def _carry_files(src: Path, dst: Path, *, remote_code: bool) -> None:
    """Copy the files that travel with a checkpoint (`CARRIED_FILES`, `CARRIED_FOLDERS`, and the model code when
    `remote_code`) that lie within `src` (`files_within`); warn about those skipped (a link out of `src`, a FIFO...)."""
    patterns = CARRIED_FILES + (("*.py",) if remote_code else ())

    def carried(relative: str) -> bool:
        folder, _, name = relative.partition("/")
        if name:
            return folder in CARRIED_FOLDERS
        return relative in CARRIED_FOLDERS or (
            relative != CONFIG_NAME and any(fnmatch.fnmatchcase(relative, pattern) for pattern in patterns)
        )

    kept, skipped = files_within(src)
    for relative in filter(carried, kept):
        (dst / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / relative, dst / relative)
    for relative in filter(carried, skipped):
        logger.warning(f"skipped {printable(relative)}: {why_skipped(src, src / relative)}")


def check_output_folder(dst: str | os.PathLike, sources: Iterable[str | os.PathLike], *, overwrite: bool) -> Path:
    """Where output folder `dst` is written (`resolve_destination`), after checking that writing it there loses
    nothing; for every command that writes a folder from folders it reads (`convert`, `export`). Refused:

    - `dst` equal to one of `sources` (the folders read: a checkpoint, its run), inside one or containing one
      (`InputError`): the output would replace its own input;
    - a non-empty `dst` without `overwrite` (`FileExistsError`);
    - with `overwrite`, a `dst` that is not an earlier output (`InputError`): a training run (its `checkpoints/`,
      `trainer_state.json`, DCP shards, `metrics.jsonl`), or a folder holding anything a model folder of hf-p2r does
      not (`MODEL_FOLDER_FILES`, `CARRIED_FILES`, `CARRIED_FOLDERS`: your own files are never replaced).
    """
    destination = resolve_destination(dst).resolve()
    for source in sources:
        source = Path(os.path.realpath(source))
        if destination == source or destination.is_relative_to(source) or source.is_relative_to(destination):
            raise InputError(
                f"{printable(dst)}: the output must not be the source {printable(source)}, inside it, or contain it"
            )
    if not destination.is_dir() or not any(destination.iterdir()):
        return destination
    if not overwrite:
        raise FileExistsError(
            f"{printable(destination)}: folder is not empty (overwrite=True, or --overwrite, replaces it)"
        )
    entries = sorted(destination.iterdir())
    if run := [entry.name for entry in entries if entry.name in TRAINING_RUN_FILES]:
        raise InputError(
            f"{printable(dst)}: holds a training run ({', '.join(run)}); --overwrite replaces only an earlier output "
            "of this command, never a run: choose another output folder"
        )
    if foreign := [entry.name for entry in entries if not _model_folder_entry(entry)]:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise InputError(
            f"{printable(dst)}: holds {', '.join(printable(name, 80) for name in foreign[:3])}{more}, which no model "
            "folder of hf-p2r holds; --overwrite replaces only an earlier output of this command (a model folder): "
            "choose another output folder, or empty this one"
        )
    return destination


def _model_folder_entry(entry: Path) -> bool:
    """Whether `entry` (of a folder) is what a model folder of hf-p2r holds: its files, or a carried folder."""
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return entry.name in CARRIED_FOLDERS
    patterns = MODEL_FOLDER_FILES + CARRIED_FILES
    return entry.is_file() and any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in patterns)


def parse_dtype(dtype) -> str | None:
    """The output dtype's name: None (keep the source's), or one of `DTYPES` given as a name ("bfloat16",
    "torch.bfloat16") or a `torch.dtype`. Others (float8, integers) would write a checkpoint transformers cannot load
    as it is."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    return name
