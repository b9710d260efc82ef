"""Real P2R checkpoints are Llama checkpoints: same tensors, same names; only config.json differs."""

import os
from pathlib import Path

from transformers import LlamaConfig

from ..models.p2r import P2RConfig, P2RForCausalLM
from .io import atomic_directory

# Fields of a P2R config.json that Llama does not have (or must not inherit).
_NOT_LLAMA = ("share_layers", "num_unique_layers", "sharing_pattern", "auto_map", "model_type", "transformers_version")


def llama_config(config: P2RConfig) -> LlamaConfig:
    """The `LlamaConfig` of a real (delinked) P2R model; a pseudo model has no Llama equivalent."""
    if config.share_layers:
        raise ValueError(
            "config: share_layers=True (a pseudo model) has no Llama equivalent; delink() the model, or convert the "
            "checkpoint with hf_p2r.convert_pseudo_to_real(..., target='llama')"
        )
    fields = {key: value for key, value in config.to_dict().items() if key not in _NOT_LLAMA}
    fields["architectures"] = ["LlamaForCausalLM"]
    return LlamaConfig.from_dict(fields)


def export_llama(
    model: P2RForCausalLM, save_directory: str | os.PathLike, *, overwrite: bool = False, **save_kwargs
) -> Path:
    """Save a real P2R model as a vanilla `LlamaForCausalLM` checkpoint (written atomically); returns the folder.

    ```python
    >>> export_llama(pseudo.delink(), "llama_out")
    >>> LlamaForCausalLM.from_pretrained("llama_out")   # same logits, no hf_p2r needed
    ```
    """
    config = llama_config(model.config)
    with atomic_directory(save_directory, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, **save_kwargs)
        config.save_pretrained(tmp)  # replaces the P2R config.json
    return Path(save_directory)
