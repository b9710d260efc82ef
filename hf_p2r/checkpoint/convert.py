"""Pseudo -> real conversion on disk: every depth gets its own copy of its block's weights, streamed.

The source is read memory-mapped and each output shard is written by safetensors from pointers into it, so the real
model is never held in memory (see `writer.py`); which block each new block copies comes from the model's own
`delink_parameter_map`, so a converted checkpoint and `model.delink()` agree by construction.
"""

import copy
import os
import shutil
from pathlib import Path
from typing import Literal

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import CHAT_TEMPLATE_DIR, CONFIG_NAME, GENERATION_CONFIG_NAME

from ..models.p2r import P2RConfig, P2RForCausalLM
from ..models.p2r.modeling_p2r import _LAYER_KEY
from .io import atomic_directory, read_config_dict
from .llama import llama_config
from .reader import CheckpointReader
from .writer import output_dtype, parse_size, write_checkpoint

# Files other than weights and config.json that travel with a checkpoint (tokenizer and generation settings).
CARRIED_FILES = (
    GENERATION_CONFIG_NAME,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
)
# Folders that travel with it: transformers' named chat templates (additional_chat_templates/<name>.jinja).
CARRIED_FOLDERS = (CHAT_TEMPLATE_DIR,)
# dtypes an output can be cast to: those transformers loads without a quantization config.
DTYPES = ("float32", "float16", "bfloat16", "float64")


def convert_pseudo_to_real(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    num_unique_layers: int | None = None,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    target: Literal["p2r", "llama"] = "p2r",
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the pseudo checkpoint folder `src` into a real one in `dst` (or, with `num_unique_layers=k'`, into a
    pseudo one with more blocks); returns `dst`.

    The output loads with `from_pretrained` and equals the delinked model tensor for tensor: as `P2RForCausalLM`
    (`target="p2r"`, config with `share_layers=False`), or as a vanilla `LlamaForCausalLM` (`target="llama"`, real
    only). Weights are streamed: the source is memory-mapped, each shard (at most `max_shard_size`, e.g. "5GB" or
    a number of bytes) is written by safetensors, and anonymous memory stays constant whatever the model size. `dtype`
    (float32, float16, bfloat16 or float64) casts the weights. generation_config.json, tokenizer files and named chat
    templates (and, for `target="p2r"` from a source with remote code, the model code) are carried over, and README.md
    is a model card recording where the checkpoint came from.

    `src` is only read. The output is built in a temporary folder beside `dst` and renamed into place at the end: on
    any error (bad input, disk full, Ctrl-C) `dst` is left as it was. A non-empty `dst` is refused unless `overwrite`.
    `verify=True` reopens the output before the rename and checks names, shapes, dtypes and every byte against the
    source.

    ```python
    >>> convert_pseudo_to_real("pseudo_1x24", "real_24", dtype="bfloat16")
    >>> convert_pseudo_to_real("pseudo_1x24", "pseudo_4x24", num_unique_layers=4)   # partial: 1 -> 4 blocks
    ```
    """
    max_shard_size, dtype = parse_size(max_shard_size), parse_dtype(dtype)  # before reading anything
    src = Path(src)
    config = read_p2r_config(src)
    if not config.share_layers:
        raise ValueError(
            f"{src / CONFIG_NAME}: share_layers is false: {src} is already a real checkpoint, there is nothing to "
            f"delink (use hf_p2r.export_llama({str(src)!r}, dst) for a vanilla Llama copy)"
        )
    if target not in ("p2r", "llama"):
        raise ValueError(f"target must be 'p2r' or 'llama', got {target!r}")
    blocks = config.num_hidden_layers if num_unique_layers is None else num_unique_layers
    if target == "llama" and blocks != config.num_hidden_layers:
        raise ValueError(
            f"target='llama' needs the real model (one block per layer): num_unique_layers={num_unique_layers} is "
            f"not num_hidden_layers ({config.num_hidden_layers})"
        )
    return rewrite_checkpoint(
        src,
        dst,
        config,
        num_blocks=blocks,
        target=target,
        max_shard_size=max_shard_size,
        dtype=dtype,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
    )


def read_p2r_config(folder: str | os.PathLike) -> P2RConfig:
    """The `P2RConfig` of a checkpoint folder, with errors that name the file and the problem."""
    config_dict = read_config_dict(folder)
    path = Path(folder) / CONFIG_NAME
    if config_dict.get("model_type") != P2RConfig.model_type:
        found = config_dict.get("model_type")
        raise ValueError(f"{path}: model_type is {found!r}, not {P2RConfig.model_type!r}: not a P2R checkpoint")
    try:
        return P2RConfig.from_dict(config_dict)
    except (ValueError, TypeError, StrictDataclassError) as error:
        # huggingface_hub's validation errors span two lines ("Validation error for field ...:\n    TypeError: ...")
        raise ValueError(f"{path}: {' '.join(line.strip() for line in str(error).splitlines())}") from None


def rewrite_checkpoint(
    src: Path,
    dst: str | os.PathLike,
    config: P2RConfig,
    *,
    num_blocks: int,
    target: Literal["p2r", "llama"],
    max_shard_size: int,
    dtype: torch.dtype | None,
    overwrite: bool,
    verify: bool,
    progress: bool,
) -> Path:
    """Stream the checkpoint in `src` (described by `config`) into `dst` with `num_blocks` blocks (the shared engine of
    `convert_pseudo_to_real` and `export_llama`; `max_shard_size` and `dtype` already parsed)."""
    # Imported here: hf_p2r/__init__.py imports this module before it defines __version__.
    from .. import __version__
    from ..hub import render_model_card

    dst = Path(dst)
    _check_not_nested(src, dst)

    with torch.device("meta"):  # names and shapes only: no memory, no init
        stored = P2RForCausalLM(config)
    expected = {name: p.shape for name, p in stored.state_dict().items() if name not in stored.all_tied_weights_keys}
    # new name -> source name: the model's own delink map, so conversion and delink() agree by construction
    if num_blocks == config.num_blocks:
        new_to_old = {name: name for name in expected}
    else:
        try:
            new_to_old = stored.delink_parameter_map(num_blocks)
        except ValueError as error:
            raise ValueError(f"{src}: {error}") from None
    out_config = copy.deepcopy(config)
    out_config.share_layers = num_blocks < config.num_hidden_layers
    out_config.num_unique_layers = num_blocks
    if dtype is not None:
        out_config.dtype = dtype
    with torch.device("meta"):
        order = list(P2RForCausalLM(out_config).state_dict())  # the order transformers itself saves in

    with CheckpointReader(src) as reader:
        source_dtype = _check_weights(reader, config, expected)  # before any output exists
        tensors = {new: reader.get(new_to_old[new]) for new in order if new in new_to_old}
        with atomic_directory(dst, overwrite=overwrite) as tmp:
            write_checkpoint(tmp, tensors, max_shard_size=max_shard_size, dtype=dtype, progress=progress)
            (llama_config(out_config) if target == "llama" else out_config).save_pretrained(tmp)
            _carry_files(src, tmp, remote_code=target == "p2r" and hasattr(out_config, "auto_map"))
            source_dtype = str(source_dtype).removeprefix("torch.")
            out_dtype = str(dtype).removeprefix("torch.") if dtype is not None else source_dtype
            provenance = {
                "source": src.resolve().name,
                "source_kind": "pseudo" if config.share_layers else "real",
                "source_num_unique_layers": config.num_blocks,
                "num_hidden_layers": config.num_hidden_layers,
                "num_unique_layers": num_blocks,
                "sharing_pattern": config.sharing_pattern,
                "dtype": f"{out_dtype} (unchanged)"
                if out_dtype == source_dtype
                else f"{out_dtype} (cast from {source_dtype})",
                "target": target,
                "converted_with": f"hf-p2r {__version__}",
            }
            render_model_card(tmp, model_id=dst.name, provenance=provenance).save(tmp / "README.md")
            if verify:
                verify_checkpoint(tmp, {new: (t, output_dtype(t, dtype)) for new, t in tensors.items()})
    return dst


def verify_checkpoint(folder: str | os.PathLike, expected: dict[str, tuple[torch.Tensor, torch.dtype]]) -> None:
    """Check that the weights in `folder` are exactly `expected` ({name: (source tensor, dtype)}): same names,
    shapes and dtypes, and every byte equal to the source cast to that dtype. Raises `ValueError` on the first
    difference. Compares in chunks, so memory stays small."""
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
                chunk, source_chunk = flat[start : start + step], flat_source[start : start + step].to(dtype)
                # bytes, not values: NaNs compare equal to themselves, -0.0 differs from 0.0
                if not torch.equal(chunk.view(torch.uint8), source_chunk.view(torch.uint8)):
                    raise ValueError(f"{out.file_of(name)}: verify failed: {name} differs from its source")


def _check_weights(reader: CheckpointReader, config: P2RConfig, expected: dict[str, torch.Size]) -> torch.dtype:
    """The stored tensors must be exactly those of the model `config` describes, all of one floating-point dtype
    (returned). A header that relabels a tensor's dtype with one of the same size (F32 as I32, BF16 as F16) is not
    caught by safetensors: the dtype checks are what catch it."""
    config_path = reader.folder / CONFIG_NAME
    blocks = sorted({int(match["block"]) for name in reader.keys() if (match := _LAYER_KEY.match(name))})
    if blocks != list(range(config.num_blocks)):
        shown = f"blocks {blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else f"block {blocks}" if blocks else "none"
        kind = "pseudo" if config.share_layers else "real"
        raise ValueError(
            f"{reader.folder}: the weights hold {len(blocks)} layer blocks ({shown}) but {config_path} describes a "
            f"{kind} model with {config.num_blocks} (share_layers={config.share_layers}, "
            f"num_unique_layers={config.num_unique_layers}, num_hidden_layers={config.num_hidden_layers})"
        )
    if missing := sorted(expected.keys() - set(reader.keys())):
        raise ValueError(f"{reader.folder}: missing tensors that {config_path} requires: {', '.join(missing[:3])}")
    if extra := sorted(set(reader.keys()) - expected.keys()):
        raise ValueError(
            f"{reader.file_of(extra[0])}: holds tensors that the model of {config_path} does not have: "
            + ", ".join(extra[:3])
        )
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, shape in expected.items():
        found, dtype = reader.info(name)
        if found != shape:
            raise ValueError(
                f"{reader.file_of(name)}: {name} has shape {list(found)} but {config_path} implies {list(shape)}"
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"{reader.file_of(name)}: {name} is stored as {_dtype_name(dtype)}, but model weights are floating "
                "point (a header with the wrong dtype?)"
            )
        by_dtype.setdefault(dtype, []).append(name)
    if len(by_dtype) > 1:
        (common, names), *others = sorted(by_dtype.items(), key=lambda item: -len(item[1]))
        odd_dtype, odd_names = others[0]
        raise ValueError(
            f"{reader.file_of(odd_names[0])}: {odd_names[0]} is stored as {_dtype_name(odd_dtype)}, but "
            f"{len(names)} other tensors (e.g. {names[0]}) are {_dtype_name(common)}: a checkpoint's weights share one "
            "dtype (a header with the wrong dtype?)"
        )
    return next(iter(by_dtype))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _carry_files(src: Path, dst: Path, *, remote_code: bool) -> None:
    patterns = CARRIED_FILES + (("*.py",) if remote_code else ())
    for pattern in patterns:
        for path in src.glob(pattern):
            if path.is_file() and path.name != CONFIG_NAME:
                shutil.copy2(path, dst / path.name)
    for name in CARRIED_FOLDERS:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)


def _check_not_nested(src: Path, dst: Path) -> None:
    source, destination = src.resolve(), dst.resolve()
    if destination == source or destination.is_relative_to(source) or source.is_relative_to(destination):
        raise ValueError(f"{dst}: the output must not be the source {src}, inside it, or contain it")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The output dtype: None (keep the source's), or one of `DTYPES` as a name ("bfloat16", "torch.bfloat16") or a
    `torch.dtype`. Others (float8, integers) would write a checkpoint transformers cannot load as it is."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)
