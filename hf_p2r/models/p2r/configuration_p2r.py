"""P2R model configuration: a Llama-shaped decoder whose layers may share parameters (a *pseudo* model)."""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

SHARING_PATTERNS = ("cycle", "sequence")
# The config fields that say how layers share parameters.
LAYOUT_FIELDS = ("share_layers", "num_unique_layers", "sharing_pattern")


def block_of_depth(num_hidden_layers: int, num_unique_layers: int, sharing_pattern: str) -> list[int]:
    """Which of the `num_unique_layers` blocks each of the `num_hidden_layers` depths runs.

    `"cycle"`: depth i runs block i mod k (M6-10T's fully shared giant when k = 1).
    `"sequence"`: depth i runs block floor(i * k / L) (ALBERT-style groups; stacking).
    """
    if sharing_pattern == "cycle":
        return [depth % num_unique_layers for depth in range(num_hidden_layers)]
    return [depth * num_unique_layers // num_hidden_layers for depth in range(num_hidden_layers)]


def delink_sources(
    num_hidden_layers: int, num_unique_layers: int, new_num_unique_layers: int, sharing_pattern: str
) -> list[int]:
    """For delinking k -> k' blocks: the old block each new block is copied from.

    A transition is valid when it keeps the function: every depth that will run new block j ran one and the same
    old block before. With k' = L (the real model) that always holds. For `"cycle"` it holds iff k divides k'
    (e.g. 1 -> 4 -> 16); for `"sequence"` iff the new groups of depths split the old ones (e.g. k' a multiple of k
    when L is a multiple of k'). Anything else raises `ValueError`.
    """
    depth, old_k, new_k = num_hidden_layers, num_unique_layers, new_num_unique_layers
    if not isinstance(new_k, int) or not old_k < new_k <= depth:
        raise ValueError(
            f"num_unique_layers must be an integer with {old_k} < num_unique_layers <= num_hidden_layers ({depth}) "
            f"to delink a model with {old_k} blocks, got {new_k!r}"
        )
    old_map = block_of_depth(depth, old_k, sharing_pattern)
    new_map = block_of_depth(depth, new_k, sharing_pattern) if new_k < depth else list(range(depth))
    sources: dict[int, int] = {}
    for new_block, old_block in zip(new_map, old_map):
        if sources.setdefault(new_block, old_block) != old_block:
            raise ValueError(
                f"num_unique_layers={new_k} cannot be reached from {old_k} with sharing_pattern={sharing_pattern!r} "
                f"and {depth} layers: new block {new_block} would run at depths that used blocks "
                f"{sources[new_block]} and {old_block}, so delinking would change the function"
            )
    return [sources[block] for block in range(new_k)]


def validate_layout(config) -> None:
    """Check the sharing fields of `config` together, filling the default of `num_unique_layers`.

    Raises `ValueError` naming the field. Called by `P2RConfig.__post_init__` and again by `P2RModel.__init__`, because
    fields assigned after construction (`config.num_unique_layers = 0`) are not re-checked by the config itself.
    """
    if config.sharing_pattern not in SHARING_PATTERNS:
        raise ValueError(f"sharing_pattern must be one of {SHARING_PATTERNS}, got {config.sharing_pattern!r}")
    depth = config.num_hidden_layers
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {depth!r}")
    if config.share_layers:
        if config.num_unique_layers is None:
            config.num_unique_layers = 1
        if not isinstance(config.num_unique_layers, int) or not 1 <= config.num_unique_layers < depth:
            raise ValueError(
                f"num_unique_layers must be an integer with 1 <= num_unique_layers < num_hidden_layers ({depth}) "
                f"when share_layers=True, got {config.num_unique_layers!r}; use share_layers=False for a model whose "
                "every layer has its own parameters"
            )
    else:
        if config.num_unique_layers not in (None, depth):
            raise ValueError(
                f"num_unique_layers={config.num_unique_layers!r} needs share_layers=True; a real model "
                f"(share_layers=False) has num_unique_layers == num_hidden_layers ({depth})"
            )
        config.num_unique_layers = depth


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
