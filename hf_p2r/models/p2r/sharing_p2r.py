"""Which block each depth runs, which block each new block copies when a model is delinked or grown in depth, and (MoE
models) which depths are sparse.

Plain Python, no torch and no transformers: the model (`configuration_p2r`, `configuration_p2r_moe`, `modeling_p2r`)
and the on-disk converter (`hf_p2r.checkpoint`, which moves bytes without importing either) both use these functions,
so a converted checkpoint and `model.delink()` agree by construction.
"""

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

SHARING_PATTERNS = ("cycle", "sequence")
# How a model of depth d grows to L' depths: the old depth each new depth copies (`source_depths`).
GROWTH_PATTERNS = ("stack", "interleave")
# Bounds on the sizes a config may give, far above any model's and far below what would exhaust memory or time when a
# list, a model or a tensor is built from them.
MAX_LAYERS = 10_000  # num_hidden_layers (the deepest published transformers have ~1000 layers)
MAX_SIZE = 1 << 24  # widths, vocabulary and heads (Llama 3 405B: 16384 wide, 53248 intermediate, 128256 tokens)
MAX_EXPERTS = 1 << 16  # num_experts per sparse layer (DeepSeek-V3: 256)
# The fields whose types and sizes `validate_layout` checks: flags, and sizes (None allowed: derived by the config).
FLAG_FIELDS = ("share_layers", "attention_bias", "mlp_bias", "tie_word_embeddings", "depth_mup")
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
# A layer's parameters whose output is added to the residual stream (`rest` of `LAYER_KEY`): attention's o_proj, a
# dense MLP's down_proj (weights and biases), a sparse layer's experts' down projections (in memory one 3-D tensor, on
# disk Mixtral's w2 per expert). Function-preserving growth zeroes them in the new copies.
RESIDUAL_OUTPUT = re.compile(
    r"^(?:self_attn\.o_proj\.(?:weight|bias)|mlp\.down_proj\.(?:weight|bias)|mlp\.experts\.down_proj"
    r"|block_sparse_moe\.experts\.\d+\.w2\.weight)$"
)


def block_of_depth(num_hidden_layers: int, num_unique_layers: int, sharing_pattern: str) -> list[int]:
    """Which of the `num_unique_layers` blocks each of the `num_hidden_layers` depths runs.

    `"cycle"`: depth i runs block i mod k (M6-10T's fully shared giant when k = 1).
    `"sequence"`: depth i runs block floor(i * k / L) (ALBERT-style groups; stacking).
    """
    if sharing_pattern == "cycle":
        return [depth % num_unique_layers for depth in range(num_hidden_layers)]
    return [depth * num_unique_layers // num_hidden_layers for depth in range(num_hidden_layers)]


def source_depths(num_hidden_layers: int, new_num_hidden_layers: int, growth: str = "stack") -> list[int]:
    """For growing a model of depth d = `num_hidden_layers` to L' = `new_num_hidden_layers` depths: the old depth each
    new depth copies.

    `"stack"`: new depth i copies depth i mod d (G_stack, arXiv 2405.15319: the whole model stacked L'/d times, like
    the `"cycle"` sharing pattern). `"interleave"`: new depth i copies depth floor(i * d / L') (each layer repeated in
    place, like `"sequence"`). With L' = d both are the identity.
    """
    depth, new_depth = num_hidden_layers, new_num_hidden_layers
    if growth == "stack":
        return [i % depth for i in range(new_depth)]
    return [i * depth // new_depth for i in range(new_depth)]


def delink_sources(
    num_hidden_layers: int,
    num_unique_layers: int,
    new_num_unique_layers: int,
    sharing_pattern: str,
    *,
    new_num_hidden_layers: int | None = None,
    growth: str = "stack",
) -> list[int]:
    """For delinking k -> k' blocks (and growing d -> L' depths): the old block each new block is copied from.

    Without growth (`new_num_hidden_layers` None or d) a transition is valid when it keeps the function: every depth
    that will run new block j ran one and the same old block before. With k' = L (the real model) that always holds.
    For `"cycle"` it holds iff k divides k' (e.g. 1 -> 4 -> 16); for `"sequence"` iff the new groups of depths split
    the old ones (e.g. k' a multiple of k when L is a multiple of k'). Anything else raises `ValueError`.

    Growing to L' > d depths, new depth i copies old depth `source_depths(d, L', growth)[i]`, and a transition is valid
    when every depth that will run new block j copies a depth that ran one and the same old block (k' = L' always is;
    k' may equal k, e.g. a 2-block `"cycle"` model stacked from 4 to 8 depths keeps its 2 blocks).
    """
    depth, old_k, new_k = num_hidden_layers, num_unique_layers, new_num_unique_layers
    new_depth = depth if new_num_hidden_layers is None else new_num_hidden_layers
    if growth not in GROWTH_PATTERNS:
        raise ValueError(f"growth must be one of {GROWTH_PATTERNS}, got {_shown(growth)}")
    if isinstance(new_depth, bool) or not isinstance(new_depth, int) or not depth <= new_depth <= MAX_LAYERS:
        raise ValueError(
            f"num_hidden_layers must be an integer with {depth} <= num_hidden_layers <= {MAX_LAYERS} to grow a model "
            f"of {depth} layers (a delink never removes layers), got {_shown(new_depth)}"
        )
    grows = new_depth > depth
    least = old_k if grows else old_k + 1  # growing may keep the blocks (they run at more depths)
    if isinstance(new_k, bool) or not isinstance(new_k, int) or not least <= new_k <= new_depth:
        raise ValueError(
            f"num_unique_layers must be an integer with {least} <= num_unique_layers <= num_hidden_layers "
            f"({new_depth}) to delink a model with {old_k} blocks{f' grown from {depth} layers' if grows else ''}, "
            f"got {_shown(new_k)}"
        )
    old_map = block_of_depth(depth, old_k, sharing_pattern)
    new_map = block_of_depth(new_depth, new_k, sharing_pattern) if new_k < new_depth else list(range(new_depth))
    sources: dict[int, int] = {}
    for new_block, source_depth in zip(new_map, source_depths(depth, new_depth, growth)):
        old_block = old_map[source_depth]
        if sources.setdefault(new_block, old_block) != old_block:
            how = f" grown from {depth} by {growth!r}" if grows else ""
            raise ValueError(
                f"num_unique_layers={new_k} cannot be reached from {old_k} with sharing_pattern={sharing_pattern!r} "
                f"and {new_depth} layers{how}: new block {new_block} would run at depths that copy blocks "
                f"{sources[new_block]} and {old_block}, so "
                + (
                    "the new blocks would not be copies of the old ones"
                    if grows
                    else "delinking would change the function"
                )
            )
    return [sources[block] for block in range(new_k)]


@dataclass(frozen=True)
class DelinkPlan:
    """What `plan_delink` decides: the model after a delink (and growth), and how its blocks start."""

    before: tuple[int, int]  # (num_hidden_layers, blocks) of the model it is for
    sources: tuple[int, ...]  # the old block each new block starts as
    fresh: frozenset[int]  # new blocks whose residual outputs (`RESIDUAL_OUTPUT`) start at zero
    output_scale: float  # factor on the other blocks' residual outputs (depth-µP function-preserving growth), or 1
    fields: dict  # the config fields after: num_hidden_layers, num_unique_layers, share_layers, real_num_hidden_layers
    # (and, for a MoE model that grows, mlp_only_layers)

    @property
    def num_hidden_layers(self) -> int:
        return self.fields["num_hidden_layers"]

    @property
    def num_unique_layers(self) -> int:
        return self.fields["num_unique_layers"]

    def start_copy(self, name: str, tensor):
        """Make `tensor`, in place, what the parameter `name` of the model after the delink (`...layers.<new block>.
        <rest>`) starts as, given the values of the parameter it copies: zeros for a fresh block's residual outputs
        (`RESIDUAL_OUTPUT`), times `output_scale` for the other blocks' residual outputs, unchanged otherwise; returns
        it. Elementwise, so a shard of the copy (FSDP2, ZeRO-3, a pipeline stage) is started alike: one rule for
        `delink` and every engine that delinks a model held in pieces."""
        match = LAYER_KEY.match(name)
        if match is None or not RESIDUAL_OUTPUT.match(match["rest"]):
            return tensor
        if int(match["block"]) in self.fresh:
            return tensor.zero_()
        return tensor.mul_(self.output_scale) if self.output_scale != 1.0 else tensor


def plan_delink(
    config,
    num_unique_layers: int | None = None,
    *,
    num_hidden_layers: int | None = None,
    growth: str = "stack",
    function_preserving: bool = False,
) -> DelinkPlan:
    """The delink of the model `config` describes (a `P2RConfig`, or a config.json's dict with the sharing fields
    filled, as `hf_p2r.checkpoint.read_p2r_config_dict` gives it) to `num_unique_layers` blocks and `num_hidden_layers`
    depths.

    Defaults: with neither given, the real model (`real_depth(config)` depths, one block each); with only
    `num_unique_layers`, the same depth; with only `num_hidden_layers`, one block per depth. Depths that grow copy
    `source_depths(..., growth)`; `delink_sources` says which transitions are valid (`ValueError` otherwise, or when
    there is nothing to delink).

    `function_preserving=True`: of the new depths that copy one old depth, the first keeps the copied block's weights
    and the later ones start with zero residual outputs (`RESIDUAL_OUTPUT`: o_proj, down_proj), so they add nothing to
    the residual stream and the grown model computes the old model's function. With `"stack"` the first d depths are
    the old model and the L' - d above it start at zero; with `"interleave"` each old layer is followed by its zeroed
    repeats. A shared block must run only at first copies or only at later ones (`ValueError` naming it otherwise).
    Under depth-µP (`depth_mup`) growing changes every branch's multiplier from 1/sqrt(d) to 1/sqrt(L'), so the kept
    blocks' residual outputs are also multiplied by sqrt(L'/d) (`output_scale`): equal function to rounding, not
    bitwise. Without growth there is nothing new: the flag changes nothing.
    """
    if isinstance(config, Mapping):
        config = SimpleNamespace(**config)
    depth, real = config.num_hidden_layers, real_depth(config)
    blocks = config.num_unique_layers if config.share_layers else depth
    if num_hidden_layers is None:
        num_hidden_layers = real if num_unique_layers is None else depth
    if num_unique_layers is None:
        num_unique_layers = num_hidden_layers
    if not config.share_layers and num_hidden_layers == depth:
        if depth == real:
            raise ValueError("this model is already real (share_layers=False): there is nothing to delink")
        raise ValueError(
            f"this model has its own block at each of its {depth} layers (share_layers=False): there is nothing to "
            f"delink at that depth; grow it (num_hidden_layers > {depth}; its real depth is {real})"
        )
    sources = delink_sources(
        depth, blocks, num_unique_layers, config.sharing_pattern, new_num_hidden_layers=num_hidden_layers, growth=growth
    )
    new_depth, new_map = num_hidden_layers, block_of_depth(num_hidden_layers, num_unique_layers, config.sharing_pattern)
    fresh, scale = frozenset(), 1.0
    if function_preserving and new_depth > depth:
        first, seen = set(), set()  # the first new depth that copies each old depth
        for new, old in enumerate(source_depths(depth, new_depth, growth)):
            if old not in seen:
                seen.add(old)
                first.add(new)
        runs: dict[int, set[bool]] = {}
        for new, block in enumerate(new_map):
            runs.setdefault(block, set()).add(new in first)
        if mixed := [block for block, kinds in runs.items() if len(kinds) > 1]:
            raise ValueError(
                f"function-preserving growth of {depth} to {new_depth} layers by {growth!r} with num_unique_layers="
                f"{num_unique_layers}: block {mixed[0]} would run both at a depth that keeps a copied layer and at one "
                "that starts at zero; use more blocks (one per layer always works)"
            )
        fresh = frozenset(block for block, kinds in runs.items() if kinds == {False})
        if getattr(config, "depth_mup", False):
            scale = math.sqrt(new_depth / depth)
    fields = {
        "num_hidden_layers": new_depth,
        "num_unique_layers": num_unique_layers,
        "share_layers": num_unique_layers < new_depth,
        "real_num_hidden_layers": real if real > new_depth else None,
    }
    if new_depth > depth and getattr(config, "decoder_sparse_step", None) is not None:
        fields["mlp_only_layers"] = _grown_dense_depths(config, new_depth, growth)
    return DelinkPlan((depth, blocks), tuple(sources), fresh, scale, fields)


def real_depth(config) -> int:
    """L, the depth of the real model: `real_num_hidden_layers` for a shallow model, else `num_hidden_layers`."""
    return getattr(config, "real_num_hidden_layers", None) or config.num_hidden_layers


def _grown_dense_depths(config, new_depth: int, growth: str) -> list[int]:
    """A growing MoE model's `mlp_only_layers`: each new depth is sparse iff the depth it copies is, expressed with the
    config's `decoder_sparse_step` (`ValueError` where that step would make a depth sparse that copies a dense one)."""
    step, depth = config.decoder_sparse_step, config.num_hidden_layers
    old = sparse_depths(depth, step, config.mlp_only_layers)
    new = [old[source] for source in source_depths(depth, new_depth, growth)]
    if off_grid := [i for i, sparse in enumerate(new) if sparse and (i + 1) % step]:
        raise ValueError(
            f"growing {depth} to {new_depth} layers by {growth!r} puts a sparse layer at depth {off_grid[0]}, where "
            f"decoder_sparse_step={step} has a dense one; use growth 'stack' with a depth that is a multiple of {step}"
        )
    return [i for i, sparse in enumerate(new) if not sparse and (i + 1) % step == 0]


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
    """Check the sharing fields and the sizes of `config`, filling the default of `num_unique_layers` (and writing
    `real_num_hidden_layers` equal to `num_hidden_layers` as None: only a shallow model records it).

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
    real = _bounded_int(config, "real_num_hidden_layers", MAX_LAYERS, optional=True)
    if real is not None and real < depth:
        raise ValueError(
            f"real_num_hidden_layers ({real}) must be at least num_hidden_layers ({depth}): it is the depth a shallow "
            "model grows to"
        )
    if real == depth:
        config.real_num_hidden_layers = None  # written only for a shallow model
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
