"""Where a pipelined P2R model is cut into stages: the cost of a stage, the cuts a model allows, the balanced split
the trainer runs, a manual split's checks, the one-line explanation of a split, and the split after a depth growth.

Plain Python on a P2R config (no torch): the planner sizes the split the trainer runs from the same functions.

Costs come from the model's inventory (`hf_p2r.models.p2r.inventory_p2r`, the one count of its tensors and FLOPs):
a stage's training FLOPs per token are its depths' (each its block's matrix products and its attention scores), plus
the head's `6 * hidden * vocab` on the last stage (the embedding lookup costs none), so a big vocabulary makes the last
stage heavy and the split gives it fewer layers; its bytes are those of the parameters it holds times 16 (fp32
weights, gradients and Adam's two moments): each distinct block its depths run once, the embeddings on the first
stage, the head on the last (with a tied head, the embeddings' copy it computes the logits with). The split minimises
the largest stage's FLOPs, then its bytes.

A `sequence` pseudo model's block has contiguous depths, so the automatic split cuts only between blocks and every
block lives on one stage (a manual `pipeline_split` that cuts through a block is refused). A `cycle` pseudo model's
every stage runs the shared blocks: each stage holds the blocks its depths use.
"""

from collections.abc import Sequence

from ...models.p2r.inventory_p2r import Inventory, inventory
from ...models.p2r.sharing_p2r import DelinkPlan, block_of_depth

BYTES_PER_PARAMETER = 16  # training state of an fp32 parameter: weight, gradient, Adam's two moments


def stage_cost(inv: Inventory, start: int, end: int, first: bool, last: bool, seq_len: int) -> tuple[float, float]:
    """(training FLOPs per token, bytes of training state) of the stage running depths [start, end) of the model
    `inv` lists (`first`: it holds the embeddings; `last`: the head)."""
    flops = sum(inv.depth_flops(depth, seq_len) for depth in range(start, end))
    return _cost(inv, flops, {inv.block_of_depth[depth] for depth in range(start, end)}, first, last)


def _cost(inv: Inventory, flops: float, blocks: set[int], first: bool, last: bool) -> tuple[float, float]:
    """`stage_cost` of depths whose FLOPs are `flops` and whose blocks are `blocks`."""
    numel = sum(inv.blocks[block].numel for block in blocks)
    if first:
        flops, numel = flops + inv.embeddings.flops, numel + inv.embeddings.numel
    if last:
        flops, numel = flops + inv.head.flops, numel + inv.head.numel
        if inv.tie_word_embeddings and not first:
            numel += inv.embeddings.numel  # the head's replica of the tied embeddings
    return flops, float(numel * BYTES_PER_PARAMETER)


def allowed_cuts(config) -> list[int]:
    """Depths where a stage may start: every depth, except inside a block of a `sequence` pseudo model."""
    order = config.block_of_depth
    if config.share_layers and config.sharing_pattern == "sequence":
        return [depth for depth in range(1, len(order)) if order[depth] != order[depth - 1]]
    return list(range(1, len(order)))


def balanced_split(config, num_stages: int, seq_len: int) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's (FLOPs, bytes) (`stage_cost`); ValueError if
    impossible. A dynamic program over the allowed cuts: O(stages x cuts^2)."""
    depth = config.num_hidden_layers
    cuts = [0, *allowed_cuts(config), depth]
    if num_stages > len(cuts) - 1:
        kind = "blocks (sequence pseudo model)" if len(cuts) - 1 < depth else "layers"
        raise ValueError(
            f"pipeline_parallel_size: {num_stages} stages need at least as many {kind}, the model has {len(cuts) - 1}"
        )
    inv = inventory(config)
    last_cut = len(cuts) - 1
    # best[s][j]: the smallest largest-stage cost of s stages covering depths [0, cuts[j]); choice: the previous cut
    # (the first one reaching it). The stage [cuts[i], cuts[j]) grows depth by depth as i goes down.
    infinite = (float("inf"), float("inf"))
    best = [[infinite] * len(cuts) for _ in range(num_stages + 1)]
    choice = [[0] * len(cuts) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for stages in range(1, num_stages + 1):
        last = stages == num_stages
        for j in range(stages, last_cut + 1):
            flops, blocks = 0.0, set()
            for i in range(j - 1, stages - 2, -1):
                for depth in range(cuts[i], cuts[i + 1]):
                    flops += inv.depth_flops(depth, seq_len)
                    blocks.add(inv.block_of_depth[depth])
                if best[stages - 1][i] == infinite:
                    continue
                cost = _cost(inv, flops, blocks, i == 0, last and j == last_cut)
                candidate = max(best[stages - 1][i], cost)
                if candidate <= best[stages][j]:  # ties: the smallest i
                    best[stages][j], choice[stages][j] = candidate, i
    bounds, j = [], len(cuts) - 1
    for stages in range(num_stages, 0, -1):
        i = choice[stages][j]
        bounds.append(cuts[j] - cuts[i])
        j = i
    return bounds[::-1]


def check_split(config, split: Sequence[int], num_stages: int) -> list[int]:
    """A manual `pipeline_split` (layers per stage) checked against the model; ValueError naming the field."""
    split = [int(count) for count in split]
    if len(split) != num_stages or any(count < 1 for count in split) or sum(split) != config.num_hidden_layers:
        raise ValueError(
            f"pipeline_split: {split} must give {num_stages} stages at least one layer each, "
            f"{config.num_hidden_layers} layers in all"
        )
    allowed = set(allowed_cuts(config))
    starts = [sum(split[:stage]) for stage in range(1, num_stages)]
    inside = [start for start in starts if start not in allowed]
    if inside:
        raise ValueError(
            f"pipeline_split: {split} starts a stage inside a shared block (at depth {inside[0]}) of this sequence "
            "pseudo model; a block's depths stay on one stage"
        )
    return split


def explain_split(config, split: Sequence[int], seq_len: int, manual: bool) -> str:
    """One log line: the split, how it was chosen, each stage's layers, FLOPs share and training-state bytes."""
    inv = inventory(config)
    parts, start = [], 0
    stage_costs = []
    for stage, count in enumerate(split):
        end = start + count
        stage_costs.append(stage_cost(inv, start, end, stage == 0, stage == len(split) - 1, seq_len))
        parts.append((start, end))
        start = end
    total = sum(flops for flops, _ in stage_costs) or 1.0
    stages = "; ".join(
        f"stage {stage}: depths {begin}-{end - 1}{' + embeddings' if stage == 0 else ''}"
        f"{' + head' if stage == len(split) - 1 else ''}, {100 * flops / total:.0f}% FLOPs, {nbytes / 2**20:.1f} MiB"
        for stage, ((begin, end), (flops, nbytes)) in enumerate(zip(parts, stage_costs, strict=True))
    )
    how = (
        "manual (pipeline_split)"
        if manual
        else "automatic: the largest stage's training FLOPs per token (then bytes) made smallest, the head's "
        f"{inv.head.flops / max(inv.depth_flops(0, seq_len), 1):.2f} layers of FLOPs counted"
        + (
            ", cuts between blocks only (sequence)"
            if config.share_layers and config.sharing_pattern == "sequence"
            else ""
        )
    )
    return f"pipeline split {list(split)} ({how}): {stages}"


def grown_split(config, split: Sequence[int], plan: DelinkPlan) -> list[int]:
    """The layers per stage after the delink `plan` of the pipelined model `config` describes (split `split`), done
    where the model is (`delink_stages`): without growth, the split. Growing d -> L' layers, stage [a, b) runs new
    layers [ceil(a L' / d), ceil(b L' / d)) (at least one each, the split's proportions kept; the whole model as one
    stage runs them all), so that with "interleave" growth (new layer i copies floor(i d / L')) every stage runs the
    copies of its own layers. Each new layer's block must copy a block the stage holds, since no weight moves between
    processes: "stack" growth (layer i copies i mod d) over several stages gives a stage copies of other stages'
    blocks (a cycle model's shared blocks excepted: every stage holds them), refused in one line naming the ways out.
    """
    depth, new_depth = sum(split), plan.num_hidden_layers
    if new_depth == depth:
        return list(split)
    bounds = [-(-start * new_depth // depth) for start in (sum(split[:stage]) for stage in range(len(split) + 1))]
    new_split = [end - begin for begin, end in zip(bounds, bounds[1:])]
    old_map = config.block_of_depth
    new_map = block_of_depth(new_depth, plan.num_unique_layers, config.sharing_pattern)
    for stage, (old, new) in enumerate(zip(stage_depths(split), stage_depths(new_split), strict=True)):
        held = {old_map[layer] for layer in old}
        if missing := [layer for layer in new if plan.sources[new_map[layer]] not in held]:
            raise ValueError(
                f"pipeline parallelism: growing {depth} -> {new_depth} layers gives stage {stage} layer {missing[0]}, "
                f"a copy of block {plan.sources[new_map[missing[0]]]}, which another stage holds; grow by "
                "'interleave' (each stage repeats its own layers), on one stage (pipeline_parallel_size 1), or "
                f"convert the checkpoint (hf-p2r convert --num-hidden-layers {new_depth}) and train the grown model"
            )
    return new_split


def stage_depths(split: Sequence[int]) -> list[range]:
    """The depths each stage runs, from the layers per stage."""
    bounds = [sum(split[:stage]) for stage in range(len(split) + 1)]
    return [range(bounds[stage], bounds[stage + 1]) for stage in range(len(split))]


__all__ = [
    "BYTES_PER_PARAMETER",
    "allowed_cuts",
    "balanced_split",
    "check_split",
    "explain_split",
    "grown_split",
    "stage_cost",
    "stage_depths",
]
