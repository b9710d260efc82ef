"""Which block each depth runs, and which block each new block copies when a model is delinked.

Plain Python, no torch and no transformers: the model (`configuration_p2r`, `modeling_p2r`) and the on-disk converter
(`hf_p2r.checkpoint`, which moves bytes without importing either) both use these functions, so a converted checkpoint
and `model.delink()` agree by construction.
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
