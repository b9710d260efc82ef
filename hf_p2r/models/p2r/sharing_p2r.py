"""Which block each depth runs, which block each new block copies when a model is delinked, and (MoE models) which
depths are sparse.

Plain Python, no torch and no transformers: the model (`configuration_p2r`, `configuration_p2r_moe`, `modeling_p2r`)
and the on-disk converter (`hf_p2r.checkpoint`, which moves bytes without importing either) both use these functions,
so a converted checkpoint and `model.delink()` agree by construction.
"""

import re
from collections.abc import Iterable

SHARING_PATTERNS = ("cycle", "sequence")
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
    """Check the sharing fields of `config` together, filling the default of `num_unique_layers`.

    Raises `ValueError` naming the field. Called by `P2RConfig.__post_init__` and again by `P2RModel.__init__`, because
    fields assigned after construction (`config.num_unique_layers = 0`) are not re-checked by the config itself.
    `config` is any object with the fields as attributes (the converter checks a config.json without transformers).
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


def sparse_depths(num_hidden_layers: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> list[bool]:
    """Whether each depth 0..L-1 of a MoE model runs a sparse (router + experts) layer: depth d is sparse when (d + 1)
    is a multiple of `decoder_sparse_step` and d is not in `mlp_only_layers` (Qwen2/3-MoE's convention)."""
    dense = set(mlp_only_layers)
    return [depth not in dense and (depth + 1) % decoder_sparse_step == 0 for depth in range(num_hidden_layers)]


def _positive_int(config, name: str) -> int:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def validate_moe(config) -> None:
    """Check the MoE fields of `config` together and against its sharing; raises `ValueError` naming the field.

    Called by `P2RMoeConfig.__post_init__`, again by `P2RMoeModel.__init__` (fields may be assigned later), and by the
    converter on a config.json (`config` is then any object with the fields as attributes, after `validate_layout`).
    """
    experts, top_k = _positive_int(config, "num_experts"), _positive_int(config, "num_experts_per_tok")
    groups = _positive_int(config, "num_expert_groups")
    _positive_int(config, "moe_intermediate_size")
    _positive_int(config, "decoder_sparse_step")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be at most num_experts ({experts})")
    if groups > 1 and (experts % groups or top_k != groups):
        raise ValueError(
            f"num_expert_groups={groups} (expert prototyping: one top-1 routing per group) needs num_experts "
            f"({experts}) divisible by it and num_experts_per_tok equal to it (got {top_k})"
        )
    depth = config.num_hidden_layers
    layers = config.mlp_only_layers
    if not isinstance(layers, list) or any(isinstance(n, bool) or n not in range(depth) for n in layers):
        raise ValueError(f"mlp_only_layers must list depths in 0..{depth - 1}, got {layers!r}")
    coef = config.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0, got {coef!r}")
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
