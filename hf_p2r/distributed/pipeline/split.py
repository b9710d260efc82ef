"""Where a pipelined P2R model is cut into stages: the cost of each piece, the cuts a model allows, the balanced split
the trainer runs, a manual split's checks and the one-line explanation of a split.

Plain Python on a P2R config (no torch): the planner sizes the split the trainer runs from the same functions.

Costs (`piece_costs`): training FLOPs per token (6 per parameter of a matrix product, plus the attention scores,
12 * seq * hidden per layer) and bytes of parameters, gradients and Adam state (16 per fp32 parameter). The embedding
lookup costs no FLOPs; the head costs 6 * hidden * vocab per token, so a big vocabulary makes the last stage heavy and
the split gives it fewer layers. The split minimises the largest stage's FLOPs, then its bytes.

A `sequence` pseudo model's block has contiguous depths, so the automatic split cuts only between blocks and every
block lives on one stage (a manual `pipeline_split` that cuts through a block is refused). A `cycle` pseudo model's
every stage runs the shared blocks: each stage holds the blocks its depths use, counted once in its bytes.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PieceCost:
    """One piece of the model for the split: training FLOPs per token and bytes of training state."""

    name: str
    flops: float
    bytes: float


def piece_costs(config, seq_len: int, bytes_per_param: int = 16) -> tuple[PieceCost, list[PieceCost], PieceCost]:
    """(embeddings, one cost per depth, norm + head) of a P2R config; see the module docstring for the model.

    A depth's bytes are its block's: a pseudo model's stage holds each of its blocks once however many of its depths
    run it (`stage_cost` counts them so).
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer_params = attention + 3 * hidden * config.intermediate_size + 2 * hidden
    layer_flops = 6 * (layer_params - 2 * hidden) + 12 * seq_len * hidden
    embed = PieceCost("embeddings", 0.0, float(vocab * hidden * bytes_per_param))
    head_params = (0 if config.tie_word_embeddings else vocab * hidden) + hidden
    head = PieceCost("head", float(6 * hidden * vocab), float(head_params * bytes_per_param))
    layers = [
        PieceCost(f"layer {depth}", float(layer_flops), float(layer_params * bytes_per_param))
        for depth in range(config.num_hidden_layers)
    ]
    return embed, layers, head


def stage_cost(config, costs, start: int, end: int, first: bool, last: bool) -> tuple[float, float]:
    """(FLOPs per token, bytes) of the stage running depths [start, end)."""
    embed, layers, head = costs
    flops = sum(layers[depth].flops for depth in range(start, end))
    blocks = {config.block_of_depth[depth] for depth in range(start, end)}
    nbytes = len(blocks) * (layers[0].bytes if layers else 0.0)
    if first:
        flops, nbytes = flops + embed.flops, nbytes + embed.bytes
    if last:
        flops, nbytes = flops + head.flops, nbytes + head.bytes
    return flops, nbytes


def allowed_cuts(config) -> list[int]:
    """Depths where a stage may start: every depth, except inside a block of a `sequence` pseudo model."""
    order = config.block_of_depth
    if config.share_layers and config.sharing_pattern == "sequence":
        return [depth for depth in range(1, len(order)) if order[depth] != order[depth - 1]]
    return list(range(1, len(order)))


def balanced_split(config, num_stages: int, seq_len: int) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's (FLOPs, bytes); ValueError if impossible."""
    depth = config.num_hidden_layers
    cuts = [0, *allowed_cuts(config), depth]
    if num_stages > len(cuts) - 1:
        kind = "blocks (sequence pseudo model)" if len(cuts) - 1 < depth else "layers"
        raise ValueError(
            f"pipeline_parallel_size: {num_stages} stages need at least as many {kind}, the model has {len(cuts) - 1}"
        )
    costs = piece_costs(config, seq_len)
    # best[s][j]: the smallest largest-stage cost of s stages covering depths [0, cuts[j]); choice: the previous cut.
    infinite = (float("inf"), float("inf"))
    best = [[infinite] * len(cuts) for _ in range(num_stages + 1)]
    choice = [[0] * len(cuts) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for stages in range(1, num_stages + 1):
        for j in range(1, len(cuts)):
            for i in range(j):
                if best[stages - 1][i] == infinite:
                    continue
                cost = stage_cost(config, costs, cuts[i], cuts[j], i == 0, stages == num_stages and j == len(cuts) - 1)
                candidate = max(best[stages - 1][i], cost)
                if candidate < best[stages][j]:
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
    costs = piece_costs(config, seq_len)
    parts, start = [], 0
    stage_costs = []
    for stage, count in enumerate(split):
        end = start + count
        stage_costs.append(stage_cost(config, costs, start, end, stage == 0, stage == len(split) - 1))
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
        f"{costs[2].flops / max(costs[1][0].flops, 1):.2f} layers of FLOPs counted"
        + (
            ", cuts between blocks only (sequence)"
            if config.share_layers and config.sharing_pattern == "sequence"
            else ""
        )
    )
    return f"pipeline split {list(split)} ({how}): {stages}"


def stage_depths(split: Sequence[int]) -> list[range]:
    """The depths each stage runs, from the layers per stage."""
    bounds = [sum(split[:stage]) for stage in range(len(split) + 1)]
    return [range(bounds[stage], bounds[stage + 1]) for stage in range(len(split))]


__all__ = [
    "PieceCost",
    "allowed_cuts",
    "balanced_split",
    "check_split",
    "explain_split",
    "piece_costs",
    "stage_cost",
    "stage_depths",
]
