"""Which block each depth runs, which block each new block copies when a model is delinked, and (MoE models) which
depths are sparse.

Plain Python, no torch and no transformers: the model (`configuration_p2r`, `configuration_p2r_moe`, `modeling_p2r`)
and the on-disk converter (`hf_p2r.checkpoint`, which moves bytes without importing either) both use these functions,
so a converted checkpoint and `model.delink()` agree by construction.
"""

import re
from collections.abc import Iterable

SHARING_PATTERNS = ("cycle", "sequence")
# Bounds on the sizes a config may give, far above any model's and far below what would exhaust memory or time when a
# list, a model or a tensor is built from them.
MAX_LAYERS = 10_000  # num_hidden_layers (the deepest published transformers have ~1000 layers)
MAX_SIZE = 1 << 24  # widths, vocabulary and heads (Llama 3 405B: 16384 wide, 53248 intermediate, 128256 tokens)
MAX_EXPERTS = 1 << 16  # num_experts per sparse layer (DeepSeek-V3: 256)
# The fields whose types and sizes `validate_layout` checks: flags, and sizes (None allowed: derived by the config).
FLAG_FIELDS = ("share_layers", "attention_bias", "mlp_bias", "tie_word_embeddings")
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
OPTIONAL_SIZE_FIELDS = ("num_key_value_heads", "head_dim")
# A parameter of a transformer layer: `<prefix>layers.<block>.<rest>` (e.g. model.layers.3.mlp.up_proj.weight).
LAYER_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<block>\d+)\.(?P<rest>.+)$")


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
            f"to delink a model with {old_k} blocks, got {_shown(new_k)}"
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


def delink_names(names: Iterable[str], sources: list[int]) -> dict[str, str]:
    """{name after delinking -> name now} for the parameter `names` of a model, given `sources` (the old block of each
    new block, from `delink_sources`): a layer's parameter is listed once per copy of its block, the others once.

    ```python
    >>> delink_names(["model.layers.0.mlp.up_proj.weight", "lm_head.weight"], [0, 0])
    {'model.layers.0.mlp.up_proj.weight': 'model.layers.0.mlp.up_proj.weight',
     'model.layers.1.mlp.up_proj.weight': 'model.layers.0.mlp.up_proj.weight', 'lm_head.weight': 'lm_head.weight'}
    ```
    """
    copies: dict[int, list[int]] = {}
    for new_block, old_block in enumerate(sources):
        copies.setdefault(old_block, []).append(new_block)
    mapping = {}
    for name in names:
        match = LAYER_KEY.match(name)
        if match is None:
            mapping[name] = name
            continue
        for new_block in copies[int(match["block"])]:
            mapping[f"{match['prefix']}{new_block}.{match['rest']}"] = name
    return mapping


def validate_layout(config) -> None:
    """Check the sharing fields and the sizes of `config`, filling the default of `num_unique_layers`.

    Raises `ValueError` naming the field. Called by `P2RConfig.__post_init__` and again by `P2RModel.__init__`, because
    fields assigned after construction (`config.num_unique_layers = 0`) are not re-checked by the config itself, and by
    the converter and the planner on a config.json: one rule for a config.json, whoever reads it. `config` is any
    object with the fields as attributes (the converter checks a config.json without transformers).

    Sizes are bounded (`MAX_LAYERS`, `MAX_SIZE`) before anything builds a list, a model or a tensor that grows with
    them: a config.json with `num_hidden_layers: 1e9` is one line, not a `MemoryError`.
    """
    for name in FLAG_FIELDS:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {_shown(getattr(config, name))}")
    for name in SIZE_FIELDS:
        _bounded_int(config, name, MAX_SIZE, optional=name in OPTIONAL_SIZE_FIELDS)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if config.hidden_size % heads:  # as Llama's config requires, whatever head_dim says
        raise ValueError(f"hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads ({heads})")
    if (config.head_dim or config.hidden_size // heads) % 2:
        raise ValueError(
            f"head_dim ({config.head_dim or f'hidden_size / num_attention_heads = {config.hidden_size // heads}'}) "
            "must be even: rotary embeddings turn pairs of dimensions"
        )
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if not isinstance(config.sharing_pattern, str) or config.sharing_pattern not in SHARING_PATTERNS:
        raise ValueError(f"sharing_pattern must be one of {SHARING_PATTERNS}, got {_shown(config.sharing_pattern)}")
    depth = _bounded_int(config, "num_hidden_layers", MAX_LAYERS)
    blocks = config.num_unique_layers
    if config.share_layers:
        if blocks is None:
            config.num_unique_layers = blocks = 1
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks < depth:
            raise ValueError(
                f"num_unique_layers must be an integer with 1 <= num_unique_layers < num_hidden_layers ({depth}) "
                f"when share_layers=True, got {_shown(blocks)}; use share_layers=False for a model whose every layer "
                "has its own parameters"
            )
    else:
        if blocks is not None and (isinstance(blocks, bool) or blocks != depth):
            raise ValueError(
                f"num_unique_layers={_shown(blocks)} needs share_layers=True; a real model (share_layers=False) has "
                f"num_unique_layers == num_hidden_layers ({depth})"
            )
        config.num_unique_layers = depth


def _bounded_int(config, name: str, bound: int, *, optional: bool = False) -> int | None:
    """The field `name` of `config`: an integer 1..`bound` (or None when `optional`); else `ValueError` naming it."""
    value = getattr(config, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {_shown(value)}")
    if value > bound:
        raise ValueError(f"{name} is {value}, more than any model has (at most {bound})")
    return value


def _shown(value, limit: int = 120) -> str:
    """repr(value) for a message, cut to `limit` characters (a config.json may hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def reachable_block_counts(num_hidden_layers: int, num_unique_layers: int, sharing_pattern: str) -> list[int]:
    """The block counts k' that a model with `num_unique_layers` blocks can be delinked to (`delink_sources` accepts
    them), in increasing order; the last is always `num_hidden_layers` (the real model).

    `"cycle"`: the multiples of k below L, and L. `"sequence"`: the k' whose groups of depths split the old groups
    (every depth where an old group starts starts a new group), checked in O(k) per candidate.
    """
    depth, old = num_hidden_layers, num_unique_layers
    if sharing_pattern == "cycle":
        return [*range(2 * old, depth, old), depth]
    starts = [-(-group * depth // old) for group in range(1, old)]  # first depth of each old group but the first
    return [
        new
        for new in range(old + 1, depth)
        if all(start * new // depth != (start - 1) * new // depth for start in starts)
    ] + [depth]


def sparse_depths(num_hidden_layers: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> list[bool]:
    """Whether each depth 0..L-1 of a MoE model runs a sparse (router + experts) layer: depth d is sparse when (d + 1)
    is a multiple of `decoder_sparse_step` and d is not in `mlp_only_layers` (Qwen2/3-MoE's convention)."""
    dense = set(mlp_only_layers)
    return [depth not in dense and (depth + 1) % decoder_sparse_step == 0 for depth in range(num_hidden_layers)]


def validate_moe(config) -> None:
    """Check the MoE fields of `config` together and against its sharing; raises `ValueError` naming the field.

    Called by `P2RMoeConfig.__post_init__`, again by `P2RMoeModel.__init__` (fields may be assigned later), and by the
    converter on a config.json (`config` is then any object with the fields as attributes, after `validate_layout`).
    """
    experts = _bounded_int(config, "num_experts", MAX_EXPERTS)
    top_k = _bounded_int(config, "num_experts_per_tok", MAX_EXPERTS)
    groups = _bounded_int(config, "num_expert_groups", MAX_EXPERTS)
    _bounded_int(config, "moe_intermediate_size", MAX_SIZE)
    _bounded_int(config, "decoder_sparse_step", MAX_LAYERS)
    for flag in ("norm_topk_prob", "output_router_logits"):
        if not isinstance(getattr(config, flag), bool):
            raise ValueError(f"{flag} must be true or false, got {_shown(getattr(config, flag))}")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be at most num_experts ({experts})")
    if groups > 1 and (experts % groups or top_k != groups):
        raise ValueError(
            f"num_expert_groups={groups} (expert prototyping: one top-1 routing per group) needs num_experts "
            f"({experts}) divisible by it and num_experts_per_tok equal to it (got {top_k})"
        )
    depth = config.num_hidden_layers
    layers = config.mlp_only_layers
    if not isinstance(layers, list) or any(
        isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < depth for n in layers
    ):
        raise ValueError(f"mlp_only_layers must list depths in 0..{depth - 1}, got {_shown(layers)}")
    coef = config.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0, got {_shown(coef)}")
    sparse = sparse_depths(depth, config.decoder_sparse_step, layers)
    if not any(sparse):
        raise ValueError(
            f"no layer is sparse (decoder_sparse_step={config.decoder_sparse_step}, "
            f"mlp_only_layers={layers}, num_hidden_layers={depth}); use P2RConfig for a dense model"
        )
    kinds: dict[int, bool] = {}
    num_blocks = config.num_unique_layers if config.share_layers else depth
    for layer, block in enumerate(block_of_depth(depth, num_blocks, config.sharing_pattern)):
        if kinds.setdefault(block, sparse[layer]) != sparse[layer]:
            raise ValueError(
                f"decoder_sparse_step={config.decoder_sparse_step} / mlp_only_layers={layers} make "
                f"block {block} sparse at some depths and dense at others (num_unique_layers="
                f"{config.num_unique_layers}, sharing_pattern={config.sharing_pattern!r}); every depth that runs a "
                "block must agree"
            )
