"""P2R model configuration: a Llama-shaped decoder whose layers may share parameters (a *pseudo* model)."""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .sharing_p2r import block_of_depth, delink_sources, validate_layout

# The config fields that say how layers share parameters.
LAYOUT_FIELDS = ("share_layers", "num_unique_layers", "sharing_pattern")


@strict
class P2RConfig(LlamaConfig):
    r"""
    Configuration of a P2R model: Llama's fields (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, optional tied
    embeddings) plus three that say how the transformer layers share parameters.

    `num_hidden_layers` is always the depth L, so a pseudo model does the full model's compute per token.

    Args:
        share_layers (`bool`, defaults to `False`):
            `True` for a *pseudo* model: only `num_unique_layers` blocks are stored, each run at several depths.
            `False` for the *real* model: every depth has its own block.
        num_unique_layers (`int`, *optional*):
            k, the number of distinct blocks of a pseudo model, 1 <= k < L (1 is M6-10T's fully shared giant).
            Defaults to 1 for a pseudo model; a real model always has L.
        sharing_pattern (`str`, defaults to `"cycle"`):
            `"cycle"` (depth i runs block i mod k) or `"sequence"` (depth i runs block floor(i*k/L)).

    ```python
    >>> from hf_p2r import P2RConfig, P2RForCausalLM
    >>> config = P2RConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    ...                    vocab_size=256, share_layers=True, num_unique_layers=2)
    >>> pseudo = P2RForCausalLM(config)   # stores 2 blocks, runs 8 depths
    >>> real = pseudo.delink()            # in place: 8 blocks, same function
    ```"""

    model_type = "p2r"

    share_layers: bool = False
    num_unique_layers: int | None = None
    sharing_pattern: str = "cycle"

    def __post_init__(self, **kwargs):
        # Checked here rather than in a `validate_*` method so that users get a plain `ValueError`.
        validate_layout(self)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "P2RConfig":
        """Like [`PreTrainedConfig.from_dict`], but overrides of the sharing fields are applied *before* validation.

        transformers sets keyword overrides as attributes after construction, which would skip the checks of
        `validate_layout`, and `from_pretrained(pseudo_dir, share_layers=False)` would keep the stored k. Here the
        stored `num_unique_layers` is derived again when it was derived (a real config) or sharing is turned off.
        """
        overrides = {key: kwargs.pop(key) for key in (*LAYOUT_FIELDS, "num_hidden_layers") if key in kwargs}
        merged = {**config_dict, **overrides}
        stored_pseudo = config_dict.get("share_layers", False)
        derived = not stored_pseudo and config_dict.get("num_unique_layers") == config_dict.get("num_hidden_layers")
        if "num_unique_layers" not in overrides and (derived or (stored_pseudo and not merged.get("share_layers"))):
            merged.pop("num_unique_layers", None)
        return super().from_dict(merged, **kwargs)

    @property
    def num_blocks(self) -> int:
        """Number of blocks the model stores: k for a pseudo model, L for a real one."""
        return self.num_unique_layers if self.share_layers else self.num_hidden_layers

    @property
    def block_of_depth(self) -> list[int]:
        """Block index run at each depth 0..L-1."""
        return block_of_depth(self.num_hidden_layers, self.num_blocks, self.sharing_pattern)


__all__ = ["P2RConfig", "block_of_depth", "delink_sources", "validate_layout"]
