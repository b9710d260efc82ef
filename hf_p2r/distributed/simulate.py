"""Pipeline schedules as action lists, and a simulator that times them: step time, bubble and peak memory per rank.

These machines have two CPU cores; the pipelines worth planning have 8 to 64 stages. The simulator replays a
schedule's action lists (one list per rank, in the order the rank runs them) with given per-stage forward and
backward times and a point-to-point latency, and reports what a run would take, without torch.

An action is `Action(kind, stage, microbatch)`, the compute actions of torch.distributed.pipelining's schedule IR
(`_Action`: F forward, B full backward, I / W backward for inputs / weights) plus U, 2BW's optimizer step, whose
`microbatch` is the batch it applies. `gpipe_actions` and `one_f_one_b_actions` write torch's `ScheduleGPipe` and
`Schedule1F1B` orders (tests/distributed/test_simulate.py compares them with torch's own `pipeline_order`);
`two_bw_actions` is PipeDream-2BW (arXiv 2006.09503): 1F1B over a stream of batches with no flush, and a stage's
weight update right after its last backward of each batch (hf-p2r's `SchedulePipeDream2BW` applies it a little
later, after the next batch's forwards; in steady state either costs one update per batch). `simulate` also accepts
torch's lists as they are (multi-stage schedules such as interleaved 1F1B and zero bubble), through
`hf_p2r.compat.pipeline_order`.

Timing: an action starts when its rank is free and its inputs exist (F of stage s after F of stage s - 1, B or I of
stage s after B or I of stage s + 1, W after I of the same stage; plus `p2p` seconds when the two stages sit on
different ranks), and takes its stage's time. Sends overlap compute (torch posts them asynchronously).

Memory: a micro-batch's activations on a stage live from its forward to its (weight) backward; weight versions
follow 2BW's rule that every micro-batch of batch k runs with version k - 1 (the weights after the updates of
batches 0 .. k - 2), which gives W(t+1) = W(t) - lr * grad f(W(t-1)): a stage keeps the newest version and every
older one that a batch not yet finished on it still needs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from .pipeline.schedules import ONE_STAGE_SCHEDULES, get_schedule

# The schedules whose action lists this module writes (the registry's with one stage per process); torch's lists of
# the others are simulated as they are.
SCHEDULES = ONE_STAGE_SCHEDULES
FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, UPDATE = "F", "B", "I", "W", "U"


class Action(NamedTuple):
    kind: str
    stage: int
    microbatch: int  # for UPDATE: the batch whose gradients the step applies

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class StageCost:
    """What one pipeline stage costs per micro-batch (seconds) and holds (bytes).

    `backward` is the full backward; a schedule that splits it runs `backward_input` for I (default: half) and the
    rest for W. `update` is the optimizer step (the flush schedules run it after the step, 2BW inside the stream).
    """

    forward: float
    backward: float
    weights: int = 0  # bytes of one weight version
    activations: int = 0  # bytes a micro-batch's forward saves for its backward
    update: float = 0.0
    backward_input: float | None = None

    def seconds(self, kind: str) -> float:
        split = self.backward / 2 if self.backward_input is None else self.backward_input
        return {
            FORWARD: self.forward,
            BACKWARD: self.backward,
            BACKWARD_INPUT: split,
            BACKWARD_WEIGHT: self.backward - split,
            UPDATE: self.update,
        }[kind]


@dataclass
class Simulation:
    """What `simulate` predicts. Per-rank lists are indexed by rank."""

    schedule: str
    microbatches: int  # per optimizer step
    step_time: float  # seconds per optimizer step (2BW: in steady state)
    bubble: float  # idle share of the busiest rank's step: the schedule's bubble (and send waits)
    idle: float  # idle share of all ranks' time: the bubble plus the waits of the stages lighter than the busiest
    makespan: float  # the whole simulated stream, first action to last
    peak_in_flight: list[int]  # micro-batches whose activations a rank holds at once, at most
    peak_versions: list[int]  # weight versions a rank holds at once, at most (per stage it hosts)
    peak_bytes: list[int]  # weight versions x weights + in-flight activations, at most


def gpipe_actions(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe (`ScheduleGPipe`): every forward, then every backward, then the flush."""
    _check(stages, microbatches)
    return [
        [Action(FORWARD, s, i) for i in range(microbatches)] + [Action(BACKWARD, s, i) for i in range(microbatches)]
        for s in range(stages)
    ]


def one_f_one_b_actions(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B with a flush (`Schedule1F1B`, PipeDream-Flush): stage s runs d - s forwards, then alternates one backward
    and one forward, then drains its backwards, so it holds at most d - s micro-batches."""
    return _one_f_one_b(stages, microbatches, microbatches)


def two_bw_actions(stages: int, microbatches: int, batches: int) -> list[list[Action]]:
    """PipeDream-2BW over `batches` optimizer steps of `microbatches` each: one 1F1B stream with no flush, and each
    stage's update (U) right after its last backward of a batch. Needs m >= d: batch k + 1's first forward on stage
    0 comes d - 1 forwards before batch k's last backward there, so the version it needs (k) must already exist."""
    get_schedule("2bw").check_microbatches(microbatches, stages)
    return _one_f_one_b(stages, microbatches * batches, microbatches)


def schedule_actions(schedule: str, stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """The action lists of `schedule` (one of `SCHEDULES`: "gpipe", "1f1b" or "2bw"), as the registry describes it:
    every forward before every backward (a stage holding every micro-batch: GPipe), 1F1B with a flush, or 1F1B
    streamed over `batches` steps (no flush: 2BW)."""
    spec = get_schedule(schedule)
    if spec.virtual_stages:
        raise ValueError(
            f"pipeline_schedule: {schedule} runs several stages per process; simulate torch's own action lists "
            "(hf_p2r.compat.pipeline_order) with `simulate`"
        )
    if not spec.flush:
        return two_bw_actions(stages, microbatches, batches)
    if spec.holds_every_microbatch:
        return gpipe_actions(stages, microbatches)
    return one_f_one_b_actions(stages, microbatches)


def simulate(
    actions: list[list[Action]],
    costs: list[StageCost],
    microbatches: int,
    *,
    p2p: float | list[float] = 0.0,
    schedule: str = "",
) -> Simulation:
    """Replay `actions` (one list per rank) with `costs` (one per stage) and `p2p` seconds per send between ranks
    (one figure, or one per boundary: `p2p[s]` between stages s and s + 1, either way).

    `microbatches` is the number per optimizer step. Lists with U actions (2BW) are a stream of steps: the step
    time is the mean interval between stage 0's updates, leaving out the first and the last step (pipeline fill and
    drain), so it needs at least three batches. Lists without are one flushed step: the step time is the makespan
    plus the slowest stage's optimizer step.
    """
    rank_of = {a.stage: rank for rank, ranks_actions in enumerate(actions) for a in ranks_actions}
    if sorted(rank_of) != list(range(len(costs))):
        raise ValueError(f"the actions run stages {sorted(rank_of)}, but there are {len(costs)} stage costs")
    last = len(costs) - 1
    if isinstance(p2p, (int, float)):
        p2p = [float(p2p)] * last
    elif len(p2p) != last:
        raise ValueError(f"p2p: expected one latency per stage boundary ({last}), got {len(p2p)}")
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(actions)
    position = [0] * len(actions)
    remaining = sum(map(len, actions))
    while remaining:
        progress = False
        for rank, ranks_actions in enumerate(actions):
            while position[rank] < len(ranks_actions):
                action = ranks_actions[position[rank]]
                ready = _ready_time(action, end, rank_of, last, p2p)
                if ready is None:
                    break
                start = max(free[rank], ready)
                free[rank] = end[action] = start + costs[action.stage].seconds(action.kind)
                position[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = [str(a[p]) for a, p in zip(actions, position) if p < len(a)]
            raise ValueError(f"the schedule deadlocks: every rank waits ({', '.join(stuck)})")

    stream = any(a.kind == UPDATE for ranks_actions in actions for a in ranks_actions)
    busy = [
        sum(microbatches * (costs[s].forward + costs[s].backward) + costs[s].update for s in _stages(ranks_actions))
        for ranks_actions in actions
    ]
    makespan = max(free)
    if stream:
        updates = sorted(t for (kind, stage, _), t in end.items() if kind == UPDATE and stage == 0)
        if len(updates) < 3:
            raise ValueError(f"a 2bw stream needs at least 3 batches to show its steady state, got {len(updates)}")
        step_time = (updates[-2] - updates[0]) / (len(updates) - 2)
    else:
        step_time = makespan + max(cost.update for cost in costs)
    memory = [_memory(ranks_actions, costs, microbatches) for ranks_actions in actions]
    return Simulation(
        schedule=schedule,
        microbatches=microbatches,
        step_time=step_time,
        bubble=1 - max(busy) / step_time,
        idle=1 - sum(busy) / (len(actions) * step_time),
        makespan=makespan,
        peak_in_flight=[m[0] for m in memory],
        peak_versions=[m[1] for m in memory],
        peak_bytes=[m[2] for m in memory],
    )


def simulate_schedule(
    schedule: str, costs: list[StageCost], microbatches: int, *, p2p: float | list[float] = 0.0, batches: int = 6
) -> Simulation:
    """`simulate` of `schedule_actions(schedule, len(costs), microbatches)`: one stage per rank; a schedule without a
    flush (2BW) over `batches` steps."""
    actions = schedule_actions(schedule, len(costs), microbatches, 1 if get_schedule(schedule).flush else batches)
    return simulate(actions, costs, microbatches, p2p=p2p, schedule=schedule)


def flush_bubble(stages: int, microbatches: int) -> float:
    """(d - 1) / (m + d - 1): the idle share of a flushed step with d equal stages and free communication."""
    return (stages - 1) / (microbatches + stages - 1)


def _one_f_one_b(stages: int, total: int, per_batch: int) -> list[list[Action]]:
    _check(stages, per_batch)
    lists = []
    for s in range(stages):
        warmup = min(stages - s - 1, total)
        actions = [Action(FORWARD, s, i) for i in range(warmup)]
        for i in range(total):
            if warmup + i < total:
                actions.append(Action(FORWARD, s, warmup + i))
            actions.append(Action(BACKWARD, s, i))
            if per_batch < total and (i + 1) % per_batch == 0:
                actions.append(Action(UPDATE, s, i // per_batch))
        lists.append(actions)
    return lists


def _check(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {microbatches}")


def _ready_time(action: Action, end: dict, rank_of: dict, last: int, p2p: list[float]) -> float | None:
    """When the inputs of `action` exist on its rank, or None if one has not been computed yet."""
    kind, stage, mb = action
    if kind == FORWARD:
        needs = [(FORWARD, stage - 1, mb)] if stage > 0 else []
    elif kind in (BACKWARD, BACKWARD_INPUT):
        needs = [(FORWARD, stage, mb)]
        if stage < last:
            done = [(k, stage + 1, mb) for k in (BACKWARD, BACKWARD_INPUT) if (k, stage + 1, mb) in end]
            needs.append(done[0] if done else (BACKWARD, stage + 1, mb))
    elif kind == BACKWARD_WEIGHT:
        needs = [(BACKWARD_INPUT, stage, mb)]
    elif kind == UPDATE:
        needs = []
    else:
        raise ValueError(f"unknown action kind {kind!r} in {action}")
    ready = 0.0
    for need in needs:
        if need not in end:
            return None
        if rank_of[need[1]] != rank_of[stage]:
            ready = max(ready, end[need] + p2p[min(need[1], stage)])
        else:
            ready = max(ready, end[need])
    return ready


def _stages(actions: list[Action]) -> list[int]:
    return sorted({a.stage for a in actions})


def _memory(actions: list[Action], costs: list[StageCost], microbatches: int) -> tuple[int, int, int]:
    """Peak in-flight micro-batches, weight versions (of one stage) and bytes of one rank, along its actions."""
    stages = _stages(actions)
    newest = dict.fromkeys(stages, 0)  # updates applied so far
    backwards_left = {s: Counter() for s in stages}  # batch -> backwards still to run on this stage
    for a in actions:
        if a.kind in (BACKWARD, BACKWARD_WEIGHT):
            backwards_left[a.stage][a.microbatch // microbatches] += 1
    in_flight = peak_in_flight = peak_versions = peak_bytes = 0
    activations = 0

    def versions(stage: int) -> int:
        # The newest version, and version k - 1 of every batch k that still has backwards here and may run with it
        # (k <= newest + 1: later batches need a version that does not exist yet).
        live = {newest[stage]}
        live.update(max(k - 1, 0) for k, left in backwards_left[stage].items() if left and k <= newest[stage] + 1)
        return len(live)

    for a in actions:
        batch = a.microbatch // microbatches
        if a.kind == FORWARD:
            if batch > newest[a.stage] + 1:
                raise ValueError(f"{a}: batch {batch} runs before the version it needs ({batch - 1}) exists")
            in_flight += 1
            activations += costs[a.stage].activations
        elif a.kind in (BACKWARD, BACKWARD_WEIGHT):
            in_flight -= 1
            activations -= costs[a.stage].activations
            backwards_left[a.stage][batch] -= 1
        elif a.kind == UPDATE:
            newest[a.stage] += 1
        counts = {s: versions(s) for s in stages}
        weights = sum(counts[s] * costs[s].weights for s in stages)
        peak_bytes = max(peak_bytes, weights + activations)
        peak_in_flight = max(peak_in_flight, in_flight)
        peak_versions = max(peak_versions, *counts.values())
    return peak_in_flight, peak_versions, peak_bytes


__all__ = [
    "SCHEDULES",
    "Action",
    "Simulation",
    "StageCost",
    "flush_bubble",
    "gpipe_actions",
    "one_f_one_b_actions",
    "schedule_actions",
    "simulate",
    "simulate_schedule",
    "two_bw_actions",
]
