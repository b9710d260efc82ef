"""Real MoE P2R models are Mixtral models: same modules and tensors, Mixtral's names on disk; only config.json differs.

A pseudo model (delink it first), expert prototyping (`num_expert_groups` > 1), dense layers (`decoder_sparse_step`,
`mlp_only_layers`), unnormalised top-k weights (`norm_topk_prob=False`) and attention biases have no vanilla Mixtral
equivalent and are refused with one line naming the field.
"""

import os
from pathlib import Path

from transformers import MixtralConfig

from ..models.p2r.configuration_p2r_moe import P2RMoeConfig
from ..models.p2r.modeling_p2r_moe import P2RMoeForCausalLM
from .save import save_model

# Fields that mean the same in both configs (Mixtral's experts take `intermediate_size`, ours `moe_intermediate_size`).
_SAME_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attention_dropout",
    "num_experts_per_tok",
    "output_router_logits",
    "router_aux_loss_coef",
    "rope_parameters",
    "dtype",
)


def mixtral_config(config: P2RMoeConfig) -> MixtralConfig:
    """The `MixtralConfig` of a real (delinked) MoE P2R model; raises `ValueError` naming the field that has no
    Mixtral equivalent."""
    if config.share_layers:
        raise ValueError(
            "config: share_layers=True (a pseudo model) has no Mixtral equivalent; delink() the model first"
        )
    if config.num_expert_groups > 1:
        raise ValueError(
            f"config: num_expert_groups={config.num_expert_groups} (expert prototyping, one top-1 routing per group) "
            "has no Mixtral equivalent: Mixtral routes top-k over all experts"
        )
    if not all(config.sparse_depths):
        raise ValueError(
            f"config: dense layers (decoder_sparse_step={config.decoder_sparse_step}, "
            f"mlp_only_layers={config.mlp_only_layers}) have no Mixtral equivalent: every Mixtral layer is sparse"
        )
    if not config.norm_topk_prob:
        raise ValueError(
            "config: norm_topk_prob=False has no Mixtral equivalent: Mixtral renormalises the top-k weights"
        )
    if config.attention_bias:
        raise ValueError("config: attention_bias=True has no Mixtral equivalent: Mixtral's projections have no bias")
    fields = {key: getattr(config, key) for key in _SAME_FIELDS}
    return MixtralConfig(
        **fields,
        intermediate_size=config.moe_intermediate_size,
        num_local_experts=config.num_experts,
        sliding_window=None,
        router_jitter_noise=0.0,
        architectures=["MixtralForCausalLM"],
    )


def export_mixtral(
    model: P2RMoeForCausalLM, save_directory: str | os.PathLike, *, overwrite: bool = False, **save_kwargs
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
    return save_model(model, save_directory, config=mixtral_config(model.config), overwrite=overwrite, **save_kwargs)


__all__ = ["export_mixtral", "mixtral_config"]
