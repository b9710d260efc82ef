"""P2R model configuration: a Llama-shaped decoder whose layers may share parameters (a *pseudo* model)."""

import math

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .sharing_p2r import block_of_depth, delink_sources, real_depth, validate_layout

# The config fields that say how the depths run stored blocks: sharing, and the real depth a shallow model grows to.
LAYOUT_FIELDS = ("share_layers", "num_unique_layers", "sharing_pattern", "real_num_hidden_layers")


@strict
class P2RConfig(LlamaConfig):
    r"""
    Configuration of a P2R model: Llama's fields (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, optional tied
    embeddings) plus those that say how the transformer layers share parameters, how deep the real model is, and
    whether the residual branches are scaled with depth.

    `num_hidden_layers` is the depth the model runs, d: the real depth L for a full-depth pseudo model (which does the
    real model's compute per token), fewer for a *shallow* one (a stage of depth growth, which does d/L of the layers'
    compute). A real P2R model is a Llama model.

    Args:
        share_layers (`bool`, defaults to `False`):
            `True` for a *pseudo* model: only `num_unique_layers` blocks are stored, each run at several depths.
            `False`: every depth has its own block (the *real* model, or an unshared shallow one).
        num_unique_layers (`int`, *optional*):
            k, the number of distinct blocks of a pseudo model, 1 <= k < d (1 is M6-10T's fully shared giant).
            Defaults to 1 for a pseudo model; a model that does not share has d.
        sharing_pattern (`str`, defaults to `"cycle"`):
            `"cycle"` (depth i runs block i mod k) or `"sequence"` (depth i runs block floor(i*k/d)).
        real_num_hidden_layers (`int`, *optional*):
            L, the depth of the real model, for a *shallow* model that runs d = `num_hidden_layers` < L depths and grows
            to L (`delink()`, `hf-p2r convert --num-hidden-layers`). None (the default, and what a value equal to
            `num_hidden_layers` becomes): the model runs its real depth.
        depth_mup (`bool`, defaults to `False`):
            Depth-µP: every residual branch's output (attention and MLP, each block's) is multiplied by
            1/sqrt(`num_hidden_layers`), and the branches' output projections are initialised without the usual
            1/sqrt(2 L) depth factor, as in Depth-µP (Yang, Yu, Zhu, Hayou, "Tensor Programs VI: Feature Learning in
            Infinite-Depth Neural Networks", arXiv 2310.02244: block multiplier a/sqrt(L)) and Bordelon et al.,
            "Depthwise Hyperparameter Transfer in Residual Networks" (arXiv 2309.16620): the residual stream's scale
            and each layer's share of its update stay the same as the depth changes, so hyperparameters tuned at one
            depth transfer to another. For Adam-type optimizers Depth-µP also scales the blocks' learning rate by
            1/sqrt(L) (`block_lr_scale`; the trainer applies it). TP VI shows this transfer for blocks of one layer and
            its limits for deeper blocks such as a transformer's (two layers per branch): one learning rate across a
            depth growth is a measured claim of the benchmarks, not a theorem. Growing d -> L' changes the multiplier
            from 1/sqrt(d) to 1/sqrt(L'); function-preserving growth compensates (`plan_delink`).

    ```python
    >>> from hf_p2r import P2RConfig, P2RForCausalLM
    >>> config = P2RConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    ...                    vocab_size=256, share_layers=True, num_unique_layers=2)
    >>> pseudo = P2RForCausalLM(config)   # stores 2 blocks, runs 8 depths
    >>> real = pseudo.delink()            # in place: 8 blocks, same function
    >>> shallow = P2RForCausalLM(P2RConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                    num_attention_heads=4, vocab_size=256, real_num_hidden_layers=8))
    >>> grown = shallow.delink(growth="stack", function_preserving=True)   # 8 layers: 0,1 kept, 2..7 start at zero
    ```"""

    model_type = "p2r"

    share_layers: bool = False
    num_unique_layers: int | None = None
    sharing_pattern: str = "cycle"
    real_num_hidden_layers: int | None = None
    depth_mup: bool = False

    def __post_init__(self, **kwargs):
        # Checked here rather than in a `validate_*` method so that users get a plain `ValueError`.
        validate_layout(self)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "P2RConfig":
        """Like [`PreTrainedConfig.from_dict`], but overrides of the sharing fields are applied *before* validation.

        transformers sets keyword overrides as attributes after construction, which would skip the checks of
        `validate_layout`, and `from_pretrained(pseudo_dir, share_layers=False)` would keep the stored k. Here the
        stored `num_unique_layers` is derived again when it was derived (a config that does not share) or sharing is
        turned off, and a stored `real_num_hidden_layers` below an overriding `num_hidden_layers` is dropped (the model
        grows past it: its real depth is the new one).
        """
        overrides = {key: kwargs.pop(key) for key in (*LAYOUT_FIELDS, "num_hidden_layers") if key in kwargs}
        merged = {**config_dict, **overrides}
        stored_pseudo = config_dict.get("share_layers", False)
        derived = not stored_pseudo and config_dict.get("num_unique_layers") == config_dict.get("num_hidden_layers")
        if "num_unique_layers" not in overrides and (derived or (stored_pseudo and not merged.get("share_layers"))):
            merged.pop("num_unique_layers", None)
        stored_real = config_dict.get("real_num_hidden_layers")
        grows_past = isinstance(stored_real, int) and stored_real < overrides.get("num_hidden_layers", stored_real)
        if "real_num_hidden_layers" not in overrides and grows_past:
            merged.pop("real_num_hidden_layers")
        return super().from_dict(merged, **kwargs)

    @property
    def num_blocks(self) -> int:
        """Number of blocks the model stores: k for a pseudo model, d (`num_hidden_layers`) for one that shares none."""
        return self.num_unique_layers if self.share_layers else self.num_hidden_layers

    @property
    def block_of_depth(self) -> list[int]:
        """Block index run at each depth 0..d-1."""
        return block_of_depth(self.num_hidden_layers, self.num_blocks, self.sharing_pattern)

    @property
    def real_depth(self) -> int:
        """L, the real model's depth: `real_num_hidden_layers` for a shallow model, else `num_hidden_layers`."""
        return real_depth(self)

    @property
    def residual_multiplier(self) -> float:
        """What each residual branch's output is multiplied by: 1/sqrt(num_hidden_layers) under `depth_mup`, else 1."""
        return 1 / math.sqrt(self.num_hidden_layers) if self.depth_mup else 1.0

    @property
    def block_lr_scale(self) -> float:
        """The factor Depth-µP puts on the learning rate of the blocks' parameters under Adam-type optimizers
        (TP VI, arXiv 2310.02244: eta/sqrt(L)): 1/sqrt(`num_hidden_layers`) under `depth_mup`, else 1. Changes at a
        depth growth, like `residual_multiplier`."""
        return self.residual_multiplier


__all__ = ["P2RConfig", "block_of_depth", "delink_sources", "real_depth", "validate_layout"]
