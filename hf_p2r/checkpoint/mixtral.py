"""Real MoE P2R models are Mixtral models: same modules and tensors, Mixtral's names on disk; only config.json differs.

A pseudo model (delink it first), expert prototyping (`num_expert_groups` > 1), dense layers (`decoder_sparse_step`,
`mlp_only_layers`), unnormalised top-k weights (`norm_topk_prob=False`) and attention biases have no vanilla Mixtral
equivalent and are refused with one line naming the field.

The config mapping (`mixtral_fields`) is plain Python on config.json's dict, so that `hf-p2r convert --target mixtral`
plans and writes without torch; `mixtral_config` and `export_mixtral` (a model in memory) use the same mapping.
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.p2r.sharing_p2r import sparse_depths

if TYPE_CHECKING:
    from transformers import MixtralConfig

    from ..models.p2r.configuration_p2r_moe import P2RMoeConfig
    from ..models.p2r.modeling_p2r_moe import P2RMoeForCausalLM

# Fields that mean the same in both configs (Mixtral's experts take `intermediate_size`, ours `moe_intermediate_size`),
# with P2R's default for a config.json that leaves one out (Mixtral's defaults differ: rms_norm_eps, rope_theta, ...).
# None: derived from other fields, as `P2RMoeConfig` derives it. tests/checkpoint/test_mixtral.py checks the table.
_SAME_FIELDS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # num_attention_heads
    "head_dim": None,  # hidden_size // num_attention_heads
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "rope_parameters": None,  # {"rope_type": "default", "rope_theta": rope_theta (10000.0)}
    "dtype": None,
}


def mixtral_fields(config: dict) -> dict:
    """The `MixtralConfig` fields of a real MoE P2R model from its config dict (config.json, or
    `P2RMoeConfig.to_dict()`); fields left out take P2R's defaults. No torch. Raises `ValueError` naming the field that
    has no Mixtral equivalent (whatever the sharing: the caller checks that the model is real)."""
    if config.get("depth_mup", False):
        raise ValueError(
            "depth_mup=True (residual branches scaled by 1/sqrt(num_hidden_layers)) has no Mixtral equivalent"
        )
    groups = config.get("num_expert_groups", 1)
    if groups > 1:
        raise ValueError(
            f"num_expert_groups={groups} (expert prototyping, one top-1 routing per group) has no Mixtral "
            "equivalent: Mixtral routes top-k over all experts"
        )
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if not all(sparse_depths(config.get("num_hidden_layers", 32), step, dense)):
        raise ValueError(
            f"dense layers (decoder_sparse_step={step}, mlp_only_layers={dense}) have no Mixtral equivalent: every "
            "Mixtral layer is sparse"
        )
    if not config.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=False has no Mixtral equivalent: Mixtral renormalises the top-k weights")
    if config.get("attention_bias", False):
        raise ValueError("attention_bias=True has no Mixtral equivalent: Mixtral's projections have no bias")
    fields = {key: config.get(key, default) for key, default in _SAME_FIELDS.items()}
    fields["router_aux_loss_coef"] = float(fields["router_aux_loss_coef"])  # Mixtral's config takes no int (0 for 0.0)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["rope_parameters"] is None:  # a config.json from before transformers 5: Mixtral converts it as P2R does
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        if "rope_scaling" in config:
            fields.pop("rope_parameters")
            fields.update(rope_theta=config.get("rope_theta", 10000.0), rope_scaling=config["rope_scaling"])
    intermediate = config.get("moe_intermediate_size") or config.get("intermediate_size", 11008)
    return {
        **fields,
        "intermediate_size": intermediate,
        "num_local_experts": config.get("num_experts", 8),
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "architectures": ["MixtralForCausalLM"],
    }


def mixtral_config(config: "P2RMoeConfig") -> "MixtralConfig":
    """The `MixtralConfig` of a real (delinked) MoE P2R model; raises `ValueError` naming the field that has no
    Mixtral equivalent."""
    from transformers import MixtralConfig

    if config.share_layers:
        raise ValueError(
            "config: share_layers=True (a pseudo model) has no Mixtral equivalent; delink() the model first"
        )
    try:
        fields = mixtral_fields(config.to_dict())
    except ValueError as error:
        raise ValueError(f"config: {error}") from None
    return MixtralConfig(**fields)


def export_mixtral(
    model: "P2RMoeForCausalLM", save_directory: str | os.PathLike, *, overwrite: bool = False, **save_kwargs
) -> Path:
    """Save a real MoE P2R model as a vanilla `MixtralForCausalLM` checkpoint (written atomically); returns the folder.

    The weights are written under the names transformers writes for Mixtral (`block_sparse_moe.gate.weight`,
    `block_sparse_moe.experts.<e>.w1/w2/w3.weight`), by `hf_p2r.checkpoint.save_model`, whose options `save_kwargs`
    are (`max_shard_size`, `tokenizer`, `state_dict`, `progress`); no model code is written.

    ```python
    >>> export_mixtral(pseudo.delink(), "mixtral_out")
    >>> MixtralForCausalLM.from_pretrained("mixtral_out")   # same logits, no hf_p2r needed
    ```
    """
    from .save import save_model

    return save_model(model, save_directory, config=mixtral_config(model.config), overwrite=overwrite, **save_kwargs)


__all__ = ["export_mixtral", "mixtral_config", "mixtral_fields"]
