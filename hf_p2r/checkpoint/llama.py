"""Real P2R checkpoints are Llama checkpoints: same tensors, same names; only config.json differs."""

import os
from pathlib import Path

from transformers import LlamaConfig

from ..models.p2r import P2RConfig, P2RForCausalLM
from .convert import parse_dtype, rewrite_checkpoint
from .headers import parse_size
from .save import save_model
from .source import read_p2r_config_dict
from .targets import llama_fields


def llama_config(config: P2RConfig) -> LlamaConfig:
    """The `LlamaConfig` of a real (delinked) P2R model; a pseudo model has no Llama equivalent."""
    if config.share_layers:
        raise ValueError(
            "config: share_layers=True (a pseudo model) has no Llama equivalent; delink() the model, or convert the "
            "checkpoint with hf_p2r.convert_pseudo_to_real(..., target='llama')"
        )
    return LlamaConfig.from_dict(llama_fields(config.to_dict()))


def export_llama(
    model: P2RForCausalLM | str | os.PathLike,
    save_directory: str | os.PathLike,
    *,
    overwrite: bool = False,
    **save_kwargs,
) -> Path:
    """Save a real P2R model, or copy a real P2R checkpoint folder, as a vanilla `LlamaForCausalLM` checkpoint (written
    atomically); returns the folder.

    Given a model, it is saved by `hf_p2r.checkpoint.save_model` with the Llama config (no model code); `save_kwargs`
    are its options (`max_shard_size`, `tokenizer`, `state_dict`, `progress`). Given a folder, the weights are streamed
    as they are (memory-mapped in, written shard by shard) and only config.json is rewritten; `save_kwargs` are then
    `convert_pseudo_to_real`'s writer options (`max_shard_size`, `dtype`, `verify`, `progress`), and README.md is a
    model card recording the source.

    ```python
    >>> export_llama(pseudo.delink(), "llama_out")
    >>> export_llama("real_p2r_dir", "llama_out")    # on disk, streamed
    >>> LlamaForCausalLM.from_pretrained("llama_out")   # same logits, no hf_p2r needed
    ```
    """
    if isinstance(model, (str, os.PathLike)):
        return _export_llama_folder(Path(model), save_directory, overwrite=overwrite, **save_kwargs)
    return save_model(model, save_directory, config=llama_config(model.config), overwrite=overwrite, **save_kwargs)


def _export_llama_folder(
    src: Path,
    save_directory: str | os.PathLike,
    *,
    overwrite: bool,
    max_shard_size: int | str = "5GB",
    dtype=None,
    verify: bool = False,
    progress: bool = True,
) -> Path:
    max_shard_size, dtype = parse_size(max_shard_size), parse_dtype(dtype)  # before reading anything
    config = read_p2r_config_dict(src)
    if config["share_layers"]:
        raise ValueError(
            f"{src / 'config.json'}: share_layers is true (a pseudo checkpoint) and has no Llama equivalent; use "
            f"hf_p2r.convert_pseudo_to_real({str(src)!r}, dst, target='llama')"
        )
    return rewrite_checkpoint(
        src,
        save_directory,
        config,
        num_blocks=config["num_hidden_layers"],
        target="llama",
        max_shard_size=max_shard_size,
        dtype=dtype,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
    )
