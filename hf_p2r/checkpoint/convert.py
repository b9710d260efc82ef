"""Pseudo -> real conversion on disk: every depth gets its own copy of its block's weights, streamed.

The conversion is planned from config.json (read as JSON) and the safetensors headers, without torch or
transformers, for dense (`p2r`) and mixture-of-experts (`p2r_moe`) checkpoints alike: which block each new block
copies comes from `delink_names`, the function the model's own `delink_parameter_map` uses, so a converted checkpoint
and `model.delink()` agree by construction. The output shards are then written by the kernel, header + byte ranges of
the source (`ranges.py`). Only a dtype cast, which changes the bytes, goes through torch (`writer.py`: the source
memory-mapped, cast tensor by tensor), and `verify` reopens the output with torch (`verify.py`). The same engine
exports a real checkpoint to vanilla Llama or Mixtral (only config.json changes).

The source is read and checked by `source.py` (config.json by the model's own validators, the weights against it:
one `InputError` line naming the file for every problem); the output folder is guarded, and the files that travel
with a checkpoint carried, by `output_folder.py`.

A MoE checkpoint holds its experts as transformers writes Mixtral's (`save_pretrained` reverses the load-time merge of
the 3-D expert parameters): `block_sparse_moe.experts.<e>.w1/w2/w3.weight` and `block_sparse_moe.gate.weight` per
sparse layer, so its layers are copied like any other tensors, and the same files are a Mixtral checkpoint once
config.json says so (`target="mixtral"`).
"""

import copy
import importlib.metadata
import json
import logging
import os
from pathlib import Path

from ..errors import InputError, redact
from ..models.p2r.sharing_p2r import (
    LAYER_KEY,
    RESIDUAL_OUTPUT,
    DelinkPlan,
    delink_names,
    delink_sources,
    plan_delink,
    reachable_block_counts,
)
from .headers import parse_size, read_weights
from .io import CONFIG_NAME, atomic_directory
from .output_folder import carry_files, check_output_folder
from .ranges import copying
from .source import (
    check_blocks,
    check_weights,
    cut_text,
    parameter_shapes,
    read_p2r_config,
    read_p2r_config_dict,
    source_tensor,
    split_experts,
    tensor_count,
)
from .targets import get_target
from .verify import verify_against_source, verify_checkpoint

# `read_p2r_config`, `verify_checkpoint` and `check_output_folder` moved to their own modules (source.py, verify.py,
# output_folder.py) and are still importable from here.
__all__ = [
    "DTYPES",
    "MAX_TENSORS",
    "check_output_folder",
    "conversion_blocks",
    "conversion_growth",
    "convert_pseudo_to_real",
    "output_config",
    "parameter_shapes",
    "parse_dtype",
    "read_p2r_config",
    "read_p2r_config_dict",
    "rewrite_checkpoint",
    "tensor_count",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

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
    source; the warnings and the verification's summary are logged (`logging`, loggers under `hf_p2r.checkpoint`),
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
        raise InputError(f"{src}: {cut_text(str(error))}") from None
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
    check_blocks(src, weights, config)
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

    source_dtype = check_weights(src, weights, config, expected)  # before any output exists
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
            files = verify_against_source(tmp, src, new_to_old, views, out_dtype, zeroed)
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


def growth_note(plan: DelinkPlan, zeroed: set) -> str:
    """How a grown checkpoint's new layers started, for its model card."""
    zeros = f"; {len(zeroed)} residual outputs of the later copies zeroed (function-preserving)" if zeroed else ""
    return f"each new block copies block {list(plan.sources)} of the source{zeros}"


def _write_the_rest(src, tmp, config, num_blocks, target, dtype, model_id, provenance) -> None:
    """Everything but the weights: config.json, the files that travel with a checkpoint, the model card."""
    from .card import render_model_card  # huggingface_hub's model cards (0.3 s of imports: while the kernel copies)

    out_config = output_config(config, num_blocks, target=target, dtype=dtype)
    (tmp / CONFIG_NAME).write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
    carry_files(src, tmp, remote_code=get_target(target).carries_code and "auto_map" in out_config)
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
        tensors = {new: source_tensor(reader, new_to_old[new], views, new in zeroed) for new in order}
        write_checkpoint(tmp, tensors, max_shard_size=max_shard_size, dtype=getattr(torch, dtype), progress=progress)


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
