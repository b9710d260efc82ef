"""Mixture-of-experts P2R (M6-T, M6-10T): the P2R decoder with sparse layers built from transformers' MoE blocks.

Everything about sharing (depth -> block, the KV cache slot per depth, `delink`, `from_pretrained(...,
share_layers=False)`, saving) is `modeling_p2r`'s, unchanged. What this file adds is the sparse layer: a router and
3-D expert parameters run by transformers' experts kernels (`@use_experts_implementation`: grouped_mm by default,
eager, batched_mm, ...), and the load-balancing loss computed per depth.

In memory the names are transformers' Mixtral's (`mlp.gate.weight`, `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); on disk they are what transformers writes for Mixtral (`block_sparse_moe.gate.weight`,
`block_sparse_moe.experts.<e>.w1/w2/w3.weight`), by transformers' own conversion ops registered for `p2r_moe`. Both
layouts load. Like `modeling_p2r`, this file imports nothing from `hf_p2r` outside its folder (remote code).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
from transformers.integrations import use_experts_implementation
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from .configuration_p2r import validate_layout
from .configuration_p2r_moe import P2RMoeConfig, validate_moe
from .modeling_p2r import (
    CACHE_KWARG,
    P2RAttention,
    P2RDecoderLayer,
    P2RForCausalLM,
    P2RModel,
    P2RPreTrainedModel,
    accepts_past_key_values,
    scale_branch,
)

# transformers writes Mixtral checkpoints with one tensor per expert and projection (its "original format") and loads
# them into 3-D parameters; the same ops, registered for `p2r_moe`, give P2R MoE checkpoints Mixtral's names on disk.
# Dense layers of a MoE model keep Llama's `mlp.gate_proj` names (the patterns are regexes: dots escaped).
MIXTRAL_CHECKPOINT_LAYOUT = [
    WeightRenaming(r"\.block_sparse_moe\.gate\.", r"\.mlp\.gate\."),
    WeightConverter(
        source_patterns=[".block_sparse_moe.experts.*.w1.weight", ".block_sparse_moe.experts.*.w3.weight"],
        target_patterns=".mlp.experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    ),
    WeightConverter(
        source_patterns=[".block_sparse_moe.experts.*.w2.weight"],
        target_patterns=".mlp.experts.down_proj",
        operations=[MergeModulelist(dim=0)],
    ),
]
register_checkpoint_conversion_mapping(P2RMoeConfig.model_type, MIXTRAL_CHECKPOINT_LAYOUT, overwrite=True)


class P2RMoeTopKRouter(nn.Module):
    """Mixtral's / Qwen3-MoE's top-k router, plus M6-T's expert prototyping.

    With `num_expert_groups` G > 1 the experts form G equal groups and each token takes the top-1 expert of every
    group (softmax within the group), so a token still uses G = `num_experts_per_tok` experts. Returns the router logits
    (recorded per depth for the load-balancing loss), the routing weights and the selected experts.
    """

    def __init__(self, config: P2RMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.num_groups = config.num_expert_groups
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)  # (tokens, num_experts)
        router_scores, router_indices = route(router_logits, self.top_k, self.num_groups, self.norm_topk_prob)
        return router_logits, router_scores, router_indices


def route(
    router_logits: torch.Tensor, top_k: int, num_groups: int = 1, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights and selected experts (each `(tokens, top_k)`) for `router_logits` `(tokens, num_experts)`:
    the top-k of the softmax (Mixtral, Qwen3-MoE), or with `num_groups` > 1 the top-1 of each group's softmax (M6-T)."""
    if num_groups == 1:
        router_probs = F.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    else:
        num_experts = router_logits.shape[-1]
        group_size = num_experts // num_groups
        router_probs = F.softmax(router_logits.float().view(-1, num_groups, group_size), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, 1, dim=-1)  # (tokens, groups, 1)
        offsets = torch.arange(0, num_experts, group_size, device=router_indices.device)
        router_top_value, router_indices = router_top_value.squeeze(-1), router_indices.squeeze(-1) + offsets
    if norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value, router_indices


def expert_load(router_logits: tuple[torch.Tensor, ...], config: P2RMoeConfig) -> torch.Tensor:
    """The fraction of routed tokens each expert receives (`(num_experts,)`, sums to 1; balanced: 1 / num_experts),
    averaged over the sparse depths whose `router_logits` are given (a model output's `router_logits`)."""
    with torch.no_grad():
        loads = []
        for logits in router_logits:
            _, indices = route(logits, config.num_experts_per_tok, config.num_expert_groups)
            loads.append(torch.bincount(indices.flatten(), minlength=config.num_experts).float() / indices.numel())
        return torch.stack(loads).mean(dim=0)


@use_experts_implementation
class P2RMoeExperts(Qwen3MoeExperts):
    """Qwen3-MoE's experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]: Mixtral's layout), dispatched by
    `config._experts_implementation` to transformers' kernels."""


class P2RMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: P2RMoeConfig):
        super().__init__()
        self.config = config  # for the Depth-µP branch multiplier
        self.gate = P2RMoeTopKRouter(config)
        self.experts = P2RMoeExperts(config)
        # Added to the residual stream: `_init_weights` scales its init by depth, as for the dense `down_proj`.
        self.experts.is_residual_projection = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, routing_weights, selected_experts = self.gate(hidden_states)
        hidden_states = self.experts(hidden_states, selected_experts, routing_weights)
        return scale_branch(hidden_states.reshape(batch_size, sequence_length, hidden_dim), self.config)


class P2RMoeDecoderLayer(P2RDecoderLayer):
    """P2R's decoder layer; in a sparse block the MLP is a router and experts."""

    def __init__(self, config: P2RMoeConfig, layer_idx: int, sparse: bool = True):
        super().__init__(config, layer_idx)
        if sparse:
            self.mlp = P2RMoeSparseMoeBlock(config)


class P2RMoePreTrainedModel(P2RPreTrainedModel):
    config: P2RMoeConfig
    _no_split_modules = ["P2RMoeDecoderLayer"]
    _can_record_outputs = {
        "router_logits": OutputRecorder(P2RMoeTopKRouter, index=0),
        "hidden_states": P2RMoeDecoderLayer,
        "attentions": P2RAttention,
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers caches this answer in a class attribute, which subclasses inherit: once asked, the dense parents
        # (whose module has no experts) would answer False for these classes too, and the experts would run eagerly.
        return True

    def delink(self, num_unique_layers=None, **growth):
        """`P2RPreTrainedModel.delink`; refused (`ValueError`) on a model that transformers distributed with
        `distributed_config` (expert or tensor parallelism): its parallel blocks' forwards are bound to the original
        modules, so a copy would run the original's weights. Convert the checkpoint instead (`hf-p2r convert`) and load
        the real model with the same `distributed_config`."""
        plan = self.delink_plan(num_unique_layers, **growth)  # a real model, or an invalid k', says so first
        if any(getattr(module, "_is_hooked", False) for module in self.modules()):
            raise ValueError(
                "delink() of a model distributed by transformers (distributed_config: expert or tensor parallelism) "
                "would copy blocks whose forwards run the original's weights; convert the checkpoint (hf-p2r convert) "
                "and load the real model with the same distributed_config"
            )
        return super().delink(plan)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, P2RMoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=self.residual_projection_std)
        elif isinstance(module, P2RMoeTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)


class P2RMoeModel(P2RMoePreTrainedModel, P2RModel):
    """`P2RModel` (its forward: depth -> block, cache slot per depth) with MoE decoder layers."""

    def __init__(self, config: P2RMoeConfig):
        validate_layout(config)  # again: fields may have been assigned since the config was built
        validate_moe(config)
        super().__init__(config)

    def _stored_blocks(self, config: P2RMoeConfig) -> list[nn.Module]:
        return [P2RMoeDecoderLayer(config, block, sparse) for block, sparse in enumerate(config.sparse_blocks)]

    # P2RModel's signature, not (*args, **kwargs): transformers reads the forward's parameters (main input,
    # inputs_embeds, the cache) to decide what to pass and test.
    @functools.wraps(P2RModel.forward)
    def forward(self, *args, **kwargs) -> MoeModelOutputWithPast:
        outputs = super().forward(*args, **kwargs)
        return outputs if isinstance(outputs, tuple) else MoeModelOutputWithPast(**outputs)


def router_aux_loss(
    router_logits: tuple[torch.Tensor, ...], config: P2RMoeConfig, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The load-balancing loss (Switch Transformer, transformers' `load_balancing_loss_func`) over `router_logits`, one
    entry per sparse *depth*: a router shared by n depths contributes n terms, as the n layers of the real model do.

    With expert prototyping the loss is summed over the groups, each a top-1 routing over its own experts (balanced
    routing then gives `num_experts_per_tok`, as in the ungrouped case).
    """
    if attention_mask is not None:
        # During cached generation the mask also covers the past tokens; the logits are for the new ones only.
        new_tokens = router_logits[0].shape[0] // attention_mask.shape[0]
        attention_mask = attention_mask[:, -new_tokens:]
    groups = config.num_expert_groups
    if groups == 1:
        return load_balancing_loss_func(router_logits, config.num_experts, config.num_experts_per_tok, attention_mask)
    size = config.num_experts // groups
    per_group = [tuple(logits.view(-1, groups, size)[:, group] for logits in router_logits) for group in range(groups)]
    return sum(load_balancing_loss_func(logits, size, 1, attention_mask) for logits in per_group)


class P2RMoeForCausalLM(P2RMoePreTrainedModel, P2RForCausalLM):
    base_model_class = P2RMoeModel

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        Like `P2RForCausalLM.forward`; with `output_router_logits` (default `config.output_router_logits`) the outputs
        also hold the router logits of every sparse depth and `aux_loss`, which is added to `loss`, weighted by
        `config.router_aux_loss_coef`, when `labels` are given (as in `MixtralForCausalLM`).
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )

        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits, loss = self.head_and_loss(hidden_states, labels, **kwargs)

        aux_loss = None
        if output_router_logits:
            aux_loss = router_aux_loss(outputs.router_logits, self.config, attention_mask)
            if labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)

        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
        )


__all__ = [
    "MIXTRAL_CHECKPOINT_LAYOUT",
    "P2RMoeForCausalLM",
    "P2RMoeModel",
    "P2RMoePreTrainedModel",
    "expert_load",
    "route",
    "router_aux_loss",
]
