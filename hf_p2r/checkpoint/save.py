"""Saving an in-memory model: what `save_pretrained` writes, with the weights written by this package's writer.

`save_model` is the one save path of hf-p2r's models (the trainer's `pseudo/` and `real/` folders, `export_llama` of a
model): weights through `write_checkpoint` (constant anonymous memory, file modes per the umask), config and
generation config through transformers, the model code through transformers' own `custom_object_save`.
"""

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save

from ..compat import mark_auto_class
from .headers import parse_size
from .io import atomic_directory
from .writer import write_checkpoint


def save_model(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    config: PreTrainedConfig | None = None,
    max_shard_size: int | str = "5GB",
    remote_code: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = False,
    progress: bool = True,
    write_weights: Callable[[Path, dict[str, torch.Tensor]], object] | None = None,
    converted: bool = False,
) -> Path:
    """Save `model` as a checkpoint folder that `from_pretrained` loads, atomically; returns the folder.

    The folder holds what `model.save_pretrained(folder)` writes:

    - the weights of `state_dict` (default: `model.state_dict()`) less the aliases of tied weights
      (`model.all_tied_weights_keys`, e.g. `lm_head.weight` with tied embeddings: `from_pretrained` ties them again),
      as `model.safetensors`, or shards of at most `max_shard_size` and an index, written by `write_checkpoint`;
    - config.json: `config` (default: the model's, with `architectures` set to the model's class), with `dtype` set to
      the weights' dtype, as `save_pretrained` sets it; generation_config.json when the model generates;
    - with `remote_code`, the modules that define the model's and the config's classes (with their relative imports)
      and `auto_map` in config.json, by transformers' `custom_object_save`: the folder then loads with
      `trust_remote_code=True` where hf-p2r is not installed;
    - the tokenizer's files, when `tokenizer` is given.

    Neither the model nor its config is modified. A non-empty `folder` is refused unless `overwrite`. For a model
    sharded across processes (FSDP2, pipeline stages), `sharded_write.save_model_from_shards` writes each process's
    pieces, never the whole state dict in one process: it passes `write_weights(folder, tensors)`, which replaces
    `write_checkpoint(folder, tensors)` here (`folder`: the temporary folder; `tensors`: the names to write, in order,
    as meta tensors are enough: names, dtypes, shapes), with `converted` (its `state_dict` is already under the
    names `save_pretrained` writes: a MoE model's experts one tensor per expert). Under ZeRO-3, pass each process's
    share of whole tensors (`hf_p2r.distributed.deepspeed.zero3_owned_state`) to `save_model_from_shards`, as the
    trainer does for dense models; or gather the full state dict on every process (a collective, e.g.
    `accelerator.get_state_dict(model)`) and call this on the main process only with it.

    ```python
    >>> save_model(model, "out", tokenizer=tokenizer, remote_code=True)
    >>> AutoModelForCausalLM.from_pretrained("out", trust_remote_code=True)
    ```
    """
    max_shard_size = parse_size(max_shard_size)  # before anything is written
    model_class = _model_class(model)
    if state_dict is None:
        state_dict = model.state_dict()
    # The names `save_pretrained` writes: transformers' reverse of its load-time conversions (a MoE model's 3-D
    # experts as one tensor per expert, Mixtral's layout); the identity for models without any.
    state_dict = dict(state_dict) if converted else revert_weight_conversion(model, dict(state_dict))
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    tensors = {name: t for name, t in state_dict.items() if not (name in tied and tied[name] in state_dict)}
    if config is None:
        config = copy.deepcopy(model.config)
        config.architectures = [model_class.__name__]
    else:
        config = copy.deepcopy(config)
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floating:
        config.dtype = str(floating[0]).removeprefix("torch.")

    with atomic_directory(folder, overwrite=overwrite) as tmp:
        if write_weights is not None:
            write_weights(tmp, tensors)
        else:
            write_checkpoint(tmp, tensors, max_shard_size=max_shard_size, progress=progress)
        if remote_code:
            _save_code(model_class, config, tmp)
        config.save_pretrained(tmp)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(folder)


def _model_class(model: PreTrainedModel) -> type[PreTrainedModel]:
    """The model's own class (FSDP2's `fully_shard` swaps in a subclass `FSDP<name>` defined by torch)."""
    return next(cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch."))


def _save_code(model_class: type[PreTrainedModel], config: PreTrainedConfig, folder: Path) -> None:
    """What `save_pretrained` does for a class registered with `register_for_auto_class`, for this save only: copy the
    defining modules into `folder` and record them in `config.auto_map` (the config's own when it is saved)."""
    # custom_object_save reads only the object's class and `_auto_class`: a bare instance (no __init__) stands for the
    # model, so that neither the model nor its class is changed.
    stand_in = model_class.__new__(model_class)
    auto_class = "AutoModelForCausalLM" if issubclass(model_class, GenerationMixin) else "AutoModel"
    mark_auto_class(stand_in, auto_class)
    custom_object_save(stand_in, folder, config=config)
    mark_auto_class(config, "AutoConfig")  # config.save_pretrained then copies configuration_*.py and adds AutoConfig
