"""What a checkpoint can be written as: the one registry of conversion targets (`hf-p2r convert --target`).

Each `Target` says which models it takes (by config.json's `model_type`), the `model_type` it writes for each, its
config.json (`fields`: plain Python on the config dict, raising `ValueError` naming a field it cannot express),
and whether it is a vanilla transformers model (which loads without hf-p2r, holds the real model only and carries no
model code).
`convert_pseudo_to_real`, `output_config`, `export_llama` / `export_mixtral` (`llama_config`, `mixtral_config`), the
command line's `--target` choices and the model card read it. Plain Python: the converter's fast path imports it
without torch or transformers.

```python
>>> TARGETS["llama"].writes
{'p2r': 'llama'}
>>> get_target("gguf")
InputError: target must be 'p2r', 'llama' or 'mixtral', got 'gguf'
```
"""

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError
from .mixtral import mixtral_fields

# Fields of a P2R config.json that Llama does not have (or must not inherit).
NOT_LLAMA = (
    "share_layers",
    "num_unique_layers",
    "sharing_pattern",
    "real_num_hidden_layers",  # a shallow model exports as the Llama model of its own depth
    "depth_mup",  # refused when true
    "auto_map",
    "model_type",
    "transformers_version",
)
# What a source model type is, in the words of a refusal: (this model, the models it stands for).
_KINDS = {"p2r": ("a dense model, no experts", "dense models"), "p2r_moe": ("experts", "MoE models")}


def llama_fields(config: dict) -> dict:
    """The `LlamaConfig` fields of a real dense P2R model from its config dict: P2R's own fields dropped (a real P2R
    model is a Llama model: same tensors, same names)."""
    if config.get("depth_mup", False):
        raise ValueError(
            "depth_mup=True (residual branches scaled by 1/sqrt(num_hidden_layers)) has no Llama equivalent"
        )
    return {
        **{key: value for key, value in config.items() if key not in NOT_LLAMA},
        "architectures": ["LlamaForCausalLM"],
    }


def _same_fields(config: dict) -> dict:
    return dict(config)


@dataclass(frozen=True)
class Target:
    """One checkpoint format a P2R checkpoint converts to."""

    name: str  # `--target`
    writes: dict[str, str]  # source model_type -> the model_type written
    fields: Callable[[dict], dict]  # config.json's fields from the source's (sharing fields set); ValueError: none
    vanilla: bool  # a transformers model: loads without hf-p2r, shares nothing (the real model only), no model code
    help: str  # its line in `hf-p2r convert --help`

    @property
    def real_only(self) -> bool:
        """Writes the real model only (one block per layer)."""
        return self.vanilla

    @property
    def carries_code(self) -> bool:
        """The source's model code (*.py, `auto_map`) travels with it."""
        return not self.vanilla

    def check(self, config: dict, path) -> None:
        """`ValueError` naming config.json (`path`) and the field if this target cannot write the model `config`
        describes: a model type it does not take, or a field it has no equivalent for."""
        model_type = config["model_type"]
        if model_type not in self.writes:
            takes = " or ".join(_KINDS[source][1] for source in self.writes)
            instead = [t.name for t in TARGETS.values() if t.real_only and model_type in t.writes]
            raise ValueError(
                f"{path}: model_type is {model_type!r} ({_KINDS[model_type][0]}): target={self.name!r} is for {takes}; "
                f"use {instead[0]!r}"
            )
        try:
            self.fields(config)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None


# name: (source model_type -> model_type written, config.json fields, vanilla, help)
TARGETS: dict[str, Target] = {
    name: Target(name, *entry)
    for name, entry in {
        "p2r": ({"p2r": "p2r", "p2r_moe": "p2r_moe"}, _same_fields, False, "a P2R checkpoint, dense or MoE (default)"),
        "llama": ({"p2r": "llama"}, llama_fields, True, "a vanilla LlamaForCausalLM checkpoint (dense models)"),
        "mixtral": (
            {"p2r_moe": "mixtral"},
            mixtral_fields,
            True,
            "a vanilla MixtralForCausalLM checkpoint (MoE models without expert prototyping or dense layers)",
        ),
    }.items()
}


def get_target(name: str) -> Target:
    """The registry's entry for `name`; `InputError` listing the targets for an unknown one."""
    if isinstance(name, str) and name in TARGETS:
        return TARGETS[name]
    names = list(map(repr, TARGETS))
    raise InputError(f"target must be {', '.join(names[:-1])} or {names[-1]}, got {name!r}")


def written_by(model_type: str) -> tuple[Target, str] | None:
    """(the target, the source model type) that writes checkpoints of `model_type`, or None (a model hf-p2r does
    not write)."""
    for target in TARGETS.values():
        for source, written in target.writes.items():
            if written == model_type:
                return target, source
    return None


__all__ = ["NOT_LLAMA", "TARGETS", "Target", "get_target", "llama_fields", "written_by"]
