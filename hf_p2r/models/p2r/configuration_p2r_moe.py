"""P2R mixture-of-experts configuration: `P2RConfig` (Llama's fields and the sharing fields) plus the MoE fields."""

from huggingface_hub.dataclasses import strict

from .configuration_p2r import P2RConfig
from .sharing_p2r import sparse_depths, validate_moe


@strict
class P2RMoeConfig(P2RConfig):
    r"""
    Configuration of a mixture-of-experts P2R model (M6-T / M6-10T): a P2R model whose sparse layers replace the MLP by
    `num_experts` experts and a router, as transformers' Mixtral and Qwen3-MoE do. The sharing fields
    (`share_layers`, `num_unique_layers`, `sharing_pattern`) work as in [`P2RConfig`]: a pseudo model stores k blocks,
    each with its router and experts, and runs them at `num_hidden_layers` depths.

    Args:
        num_experts (`int`, defaults to 8):
            Experts per sparse layer.
        num_experts_per_tok (`int`, defaults to 2):
            Experts each token is routed to (top-k).
        moe_intermediate_size (`int`, *optional*):
            Intermediate size of each expert; defaults to `intermediate_size` (which dense layers use).
        decoder_sparse_step (`int`, defaults to 1):
            Depth d is sparse when (d + 1) is a multiple of it (1: every layer), as in Qwen2/3-MoE.
        mlp_only_layers (`list[int]`, *optional*):
            Depths that are dense whatever `decoder_sparse_step` says.
        norm_topk_prob (`bool`, defaults to `True`):
            Renormalise the selected experts' weights to sum to 1 (Mixtral always does; Qwen3-MoE's default is not to).
        num_expert_groups (`int`, defaults to 1):
            M6-T's expert prototyping: the experts form this many equal groups and each token takes the top-1 expert
            of every group (so `num_experts_per_tok` must equal it), instead of the top-k over all experts.
        router_aux_loss_coef (`float`, defaults to 0.001):
            Weight of the load-balancing loss added to the language-modelling loss.
        output_router_logits (`bool`, defaults to `False`):
            Return the router logits of every sparse depth and compute the load-balancing loss (`aux_loss`).

    The sparse depths must agree with the sharing: all depths that run one block are sparse or all are dense
    (e.g. `decoder_sparse_step=2` with `sharing_pattern="cycle"` needs an even `num_unique_layers`).

    ```python
    >>> from hf_p2r.models.p2r.configuration_p2r_moe import P2RMoeConfig
    >>> from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM
    >>> config = P2RMoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    ...                       vocab_size=256, num_experts=4, num_experts_per_tok=2, share_layers=True)
    >>> pseudo = P2RMoeForCausalLM(config)   # one block (router + 4 experts) run at 8 depths
    >>> real = pseudo.delink()               # 8 blocks, same routing, same function
    ```"""

    model_type = "p2r_moe"
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    norm_topk_prob: bool = True
    num_expert_groups: int = 1
    router_aux_loss_coef: int | float = 0.001  # a config.json may write 0 for 0.0
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        super().__post_init__(**kwargs)
        validate_moe(self)

    @property
    def sparse_depths(self) -> list[bool]:
        """Whether each depth 0..L-1 runs a sparse (router + experts) layer."""
        return sparse_depths(self.num_hidden_layers, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def sparse_blocks(self) -> list[bool]:
        """Whether each stored block is sparse (the depths that run a block agree; `validate_moe` checks it)."""
        sparse = [False] * self.num_blocks
        for depth, block in enumerate(self.block_of_depth):
            sparse[block] = self.sparse_depths[depth]
        return sparse


__all__ = ["P2RMoeConfig", "validate_moe"]
