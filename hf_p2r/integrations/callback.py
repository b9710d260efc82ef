"""`P2RCallback`: when a P2R model delinks or grows in depth inside transformers' `Trainer` (or TRL's trainers, which
subclass it), how its optimizer state starts (the carry) and how the learning rate goes on.

The schedule is one ordered list of events: `Delink` (more blocks at the same depth) and `Grow` (more depths: depth
growth is a delink along the depths, issue 39). The callback checks it against the model when training begins, calls
the trainer's `delink` at the start of each scheduled step (`P2RTrainer`, `hf_p2r.integrations.trainer`: transformers'
Trainer builds its model, optimizer and scheduler once, so the swap itself needs the trainer), and records the model's
stage in every checkpoint's `trainer_state.json` (an `ExportableState`:
`stateful_callbacks.P2RCallback.attributes.num_hidden_layers` and `num_blocks`).

```python
callback = P2RCallback(delink_at={100: 2, 200: 4, 300: None}, carry="scale")  # 1 -> 2 -> 4 blocks -> real
callback = P2RCallback(growth=[Grow(600, num_hidden_layers=8, function_preserving=True)])  # 2 layers -> 8, stacked
```
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..models.p2r.sharing_p2r import GROWTH_PATTERNS, DelinkPlan, plan_delink, real_depth
from ..training.carry import CARRIES

logger = logging.getLogger(__name__)

LR_AFTER_DELINK = ("continue", "rewarm")
# The values every log record gets (`P2RTrainer.log`) and each event's record adds; numbers only, so that every
# `report_to` integration (TensorBoard, W&B, MLflow, ...) takes them as scalars.
NUM_BLOCKS = "p2r/num_blocks"
NUM_HIDDEN_LAYERS = "p2r/num_hidden_layers"
DELINK = "p2r/delink"
GROW = "p2r/grow"
NUM_BLOCKS_BEFORE = "p2r/num_blocks_before"
NUM_HIDDEN_LAYERS_BEFORE = "p2r/num_hidden_layers_before"


@dataclass(frozen=True)
class Delink:
    """At the start of optimizer step `step` (after `step` updates, as `TrainerState.global_step` counts them) the
    model is delinked to `blocks` blocks at its depth (None: every layer its own block; at the model's full depth, the
    real model)."""

    step: int
    blocks: int | None = None


@dataclass(frozen=True)
class Grow:
    """At the start of optimizer step `step` the model grows from its depth d to `num_hidden_layers` depths (at most
    its config's real depth), with `blocks` blocks (None: one per depth). New depth i copies old depth i mod d
    (`growth="stack"`, G_stack) or floor(i d / L') (`"interleave"`); `function_preserving=True` starts the later copies
    of each layer with zero output projections, so the grown model computes the shallow one's function
    (`P2RForCausalLM.delink`, `hf_p2r.models.p2r.sharing_p2r.plan_delink`)."""

    step: int
    num_hidden_layers: int
    blocks: int | None = None
    growth: str = "stack"
    function_preserving: bool = False


def schedule_events(delink_at) -> list[Delink]:
    """The ordered events of `delink_at`: a step (one delink to the real model), {step: blocks after it (None: the
    real model)}, or a sequence of `Delink` events or (step, blocks) pairs. `ValueError` naming `delink_at` for
    anything else, for steps that are not positive and increasing, and for block counts that do not grow."""
    if isinstance(delink_at, int) and not isinstance(delink_at, bool):
        pairs = [(delink_at, None)]
    elif isinstance(delink_at, Mapping):
        pairs = _by_step(delink_at)
    elif _is_sequence(delink_at):
        pairs = [
            (e.step, e.blocks) if isinstance(e, Delink) else tuple(e) if _is_pair(e) else (e, "?") for e in delink_at
        ]
    else:
        pairs = None
    usage = "a step (int), {step: blocks after it, None for the real model}, or a list of Delink events"
    _check_given("delink_at", delink_at, pairs, usage, "give at least the step of the delink to the real model")
    events, previous_step, previous_blocks = [], 0, 1
    for index, (step, blocks) in enumerate(pairs):
        _check_step("delink_at", step, previous_step)
        if blocks is not None and (
            isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= previous_blocks
        ):
            raise ValueError(
                f"delink_at: the blocks after each delink must be integers that grow (None: the real model); got "
                f"{blocks!r} at step {step}"
            )
        if blocks is None and index != len(pairs) - 1:
            raise ValueError(f"delink_at: the delink to the real model (step {step}) must be the last event")
        events.append(Delink(step, blocks))
        previous_step, previous_blocks = step, blocks
    return events


def growth_events(growth) -> list[Grow]:
    """The ordered events of `growth`: a `Grow`, {step: depth after it} or {step: (depth, blocks)}, or a sequence of
    `Grow` events or (step, depth[, blocks[, growth[, function_preserving]]]) tuples (as trainer_state.json keeps
    them). `ValueError` naming `growth` for anything else, for steps that are not positive and increasing, depths
    that do not grow, blocks that are not 1..depth, and an unknown mapping."""
    if isinstance(growth, Grow):
        growth = [growth]
    if isinstance(growth, Mapping):
        rows = [(step, *(value if _is_sequence(value) else (value,))) for step, value in _by_step(growth)]
    elif _is_sequence(growth):
        rows = [
            event if isinstance(event, Grow) else tuple(event) if _is_sequence(event) else (event,) for event in growth
        ]
    else:
        rows = None
    usage = "{step: depth after it}, {step: (depth, blocks)}, or a list of Grow events"
    _check_given("growth", growth, rows, usage, "give at least one Grow event")
    events, previous_step, previous_depth = [], 0, 0
    for row in rows:
        if not isinstance(row, Grow):
            if not 2 <= len(row) <= 5:
                raise ValueError(
                    f"growth: each event is (step, depth[, blocks[, growth[, function_preserving]]]), got {row!r}"
                )
            row = Grow(*row)
        step, depth, blocks = row.step, row.num_hidden_layers, row.blocks
        _check_step("growth", step, previous_step)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth <= previous_depth:
            raise ValueError(
                f"growth: the depth after each growth must be an integer that grows (a model never loses layers); got "
                f"{depth!r} at step {step}" + (f" after {previous_depth}" if previous_depth else "")
            )
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= depth):
            raise ValueError(
                f"growth: the blocks after the growth at step {step} must be an integer from 1 to its depth ({depth}), "
                f"or None (one per depth); got {blocks!r}"
            )
        if row.growth not in GROWTH_PATTERNS:
            raise ValueError(
                f"growth: step {step}: growth must be one of {', '.join(GROWTH_PATTERNS)}, got {row.growth!r}"
            )
        if not isinstance(row.function_preserving, bool):
            raise ValueError(
                f"growth: step {step}: function_preserving must be True or False, got {row.function_preserving!r}"
            )
        events.append(row)
        previous_step, previous_depth = step, depth
    return events


def event_plan(event: Delink | Grow, config) -> DelinkPlan:
    """The `DelinkPlan` of `event` for a model of `config` (a P2R config, or its dict): a delink at the model's depth
    (None: every layer its own block), a growth to its depth with its mapping (`plan_delink`)."""
    if isinstance(event, Grow):
        return plan_delink(
            config,
            event.blocks,
            num_hidden_layers=event.num_hidden_layers,
            growth=event.growth,
            function_preserving=event.function_preserving,
        )
    depth = config["num_hidden_layers"] if isinstance(config, Mapping) else config.num_hidden_layers
    return plan_delink(config, depth if event.blocks is None else event.blocks, num_hidden_layers=depth)


def _by_step(schedule: Mapping) -> list[tuple]:
    """A {step: ...} schedule's items in step order (a key that is not a step first: `_check_step` names it)."""
    return sorted(schedule.items(), key=lambda item: item[0] if isinstance(item[0], int) else 0)


def _check_given(name: str, given, rows: list | None, usage: str, empty: str) -> None:
    """`ValueError` naming the schedule `name` when it was `given` as something it cannot be (`rows` None: it says
    what to give, `usage`) or holds no event (`empty`: what it needs)."""
    if rows is None:
        raise ValueError(f"{name}: give {usage}; got {type(given).__name__}")
    if not rows:
        raise ValueError(f"{name}: the schedule is empty; {empty}")


def _check_step(name: str, step, previous: int) -> None:
    """`ValueError` naming the schedule `name` unless `step` is an integer after the `previous` event's step."""
    if isinstance(step, bool) or not isinstance(step, int) or step <= previous:
        raise ValueError(f"{name}: steps must be integers >= 1, increasing; got {step!r} after {previous}")


def _is_pair(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


class P2RCallback(TrainerCallback, ExportableState):
    """Delink a P2R model, or grow it in depth, at scheduled steps of a `Trainer` run (use it with `P2RTrainer`, or
    `p2r_trainer(cls)` for a Trainer subclass such as TRL's `SFTTrainer`).

    Args:
        delink_at: when the model delinks: a step (to the real model), {step: blocks after it} with None for every
            layer its own block (partial delinks, e.g. {100: 2, 200: 4, 300: None}), or a list of `Delink` events.
        growth: when the model grows in depth: {step: depth after it} (one block per depth, `stack`), {step: (depth,
            blocks)}, or a list of `Grow` events (which also choose `stack`/`interleave` and `function_preserving`).
            Give `delink_at`, `growth` or both: their events form one schedule, ordered by step.
        carry: how the optimizer state of the new blocks starts: `reset` (fresh), `copy` (the shared block's moments),
            `scale` (the moments times n'/n, the squared ones times (n'/n)^2; n, n': the depths a block ran at before
            and after). Parameters outside the blocks keep their state in every mode (`hf_p2r.training.carry`); a
            grown layer's state is that of the layer it copies, by the same rule.
        lr_after_delink: `continue` the learning-rate schedule where it is, or `rewarm` it: the rate times
            (steps since the event + 1) / `rewarm_steps` for `rewarm_steps` steps after each delink or growth.
        rewarm_steps: the length of the rewarm.
    """

    def __init__(
        self,
        delink_at=None,
        carry: str = "scale",
        lr_after_delink: str = "continue",
        rewarm_steps: int = 20,
        growth=None,
    ):
        if delink_at is None and growth is None:
            raise ValueError(
                "delink_at: give the steps of the delinks (delink_at=), of the depth growths (growth=), or both"
            )
        delinks = [] if delink_at is None else schedule_events(delink_at)
        grows = [] if growth is None else growth_events(growth)
        both = sorted({event.step for event in delinks} & {event.step for event in grows})
        if both:
            raise ValueError(
                f"growth: step {both[0]} is also a step of delink_at; give one event per step (a Grow's blocks= "
                "delinks as it grows)"
            )
        self.events: list[Delink | Grow] = sorted([*delinks, *grows], key=lambda event: event.step)
        if carry not in CARRIES:
            raise ValueError(f"carry: {carry!r} is not one of {', '.join(CARRIES)}")
        if lr_after_delink not in LR_AFTER_DELINK:
            raise ValueError(f"lr_after_delink: {lr_after_delink!r} is not one of {', '.join(LR_AFTER_DELINK)}")
        if isinstance(rewarm_steps, bool) or not isinstance(rewarm_steps, int) or rewarm_steps < 1:
            raise ValueError(f"rewarm_steps: must be an integer >= 1, got {rewarm_steps!r}")
        self.carry, self.lr_after_delink, self.rewarm_steps = carry, lr_after_delink, rewarm_steps
        # The model's stage now (set when training begins, after each event; in checkpoints).
        self.num_hidden_layers: int | None = None
        self.num_blocks: int | None = None
        self.events_done: int | None = None  # the events the model has been through (or was past), once training begins
        self.trainer = None  # the P2RTrainer that runs the events (it binds itself)

    @classmethod
    def from_config(cls, config) -> "P2RCallback":
        """The callback that follows the schedule of a configuration of hf-p2r's own trainer (`TrainConfig`, what
        `hf-p2r train --config ...` reads): its delinks (`delink_schedule`: the partial ones, then the real model at
        `pseudo_steps`), `optimizer_carry`, `lr_after_delink` and `rewarm_steps`."""
        depth, lr = config.model.num_hidden_layers, config.schedule
        schedule = {step: None if blocks == depth else blocks for step, blocks in config.delink_schedule()}
        return cls(schedule, config.stages.optimizer_carry, lr.lr_after_delink, lr.rewarm_steps)

    @property
    def delink_steps(self) -> list[int]:
        """The steps of every event (a growth is a delink along the depths): where `rewarm` restarts the rate."""
        return [event.step for event in self.events]

    def plans(self, model, start: int = 0) -> list[DelinkPlan | None]:
        """The `DelinkPlan` of each event from `self.events[start]` on, for `model` as it is now and followed through
        the schedule (None: an event the model is already past, at the start). Refuses, in one line naming
        `delink_at` or `growth` and the step, what the model cannot follow: a model that is not a P2R model, a
        transition `delink` refuses (`plan_delink`: a partial delink that would change the function, blocks that do
        not grow, a function-preserving growth a shared block cannot follow), a growth past the config's real depth,
        an event after one that grew or delinked that would not change the model."""
        config = getattr(model, "config", None)
        if not hasattr(model, "delink_plan") or not hasattr(config, "num_blocks"):
            raise ValueError(
                f"model: P2RCallback delinks a P2R model (hf_p2r.P2RForCausalLM, P2RMoeForCausalLM), got "
                f"{type(model).__name__}"
            )
        fields = config.to_dict()
        plans: list[DelinkPlan | None] = []
        for event in self.events[start:]:
            depth = fields["num_hidden_layers"]
            blocks = fields["num_unique_layers"] if fields["share_layers"] else depth
            name = "growth" if isinstance(event, Grow) else "delink_at"
            if isinstance(event, Grow):
                target = (event.num_hidden_layers, event.num_hidden_layers if event.blocks is None else event.blocks)
                real = real_depth(SimpleNamespace(**fields))
                if event.num_hidden_layers > real:
                    raise ValueError(
                        f"growth: step {event.step}: num_hidden_layers {event.num_hidden_layers} is more than the "
                        f"model's real depth ({real}: the config's real_num_hidden_layers, else num_hidden_layers)"
                    )
            else:
                target = (depth, depth if event.blocks is None else event.blocks)
            if target[0] <= depth and target[1] <= blocks:
                if any(plans):
                    raise ValueError(
                        f"{name}: step {event.step}: the model has {depth} layers and {blocks} blocks by then, and "
                        f"this event ({target[0]} layers, {target[1]} blocks) would not change it"
                    )
                plans.append(None)  # the model given is already past it (a later stage's checkpoint)
                continue
            try:
                plan = event_plan(event, fields)
            except ValueError as error:
                raise ValueError(f"{name}: step {event.step}: {error}") from None
            plans.append(plan)
            fields = {**fields, **plan.fields}
        return plans

    def stages(self, model) -> list[tuple[int, int]]:
        """(depth, blocks) of `model` after each event of the schedule (`plans`)."""
        stage, stages = (model.config.num_hidden_layers, model.config.num_blocks), []
        for plan in self.plans(model):
            if plan is not None:
                stage = (plan.num_hidden_layers, plan.num_unique_layers)
            stages.append(stage)
        return stages

    def check(self, model, max_steps: int, start: int = 0) -> None:
        """Refuse, in one line, a schedule this model or run cannot follow from event `start` on (`plans`), or an
        event due at or after the run's last step."""
        for event, plan in zip(self.events[start:], self.plans(model, start)):
            if plan is not None and max_steps > 0 and event.step >= max_steps:
                name = "growth" if isinstance(event, Grow) else "delink_at"
                raise ValueError(
                    f"{name}: step {event.step} is at or after the run's end (max_steps {max_steps}): the event "
                    "would never run"
                )

    # --- events --------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "P2RCallback: transformers' Trainer cannot swap its model from a callback; train with "
                "hf_p2r.integrations.P2RTrainer, or p2r_trainer(YourTrainerClass) for a subclass (TRL's SFTTrainer)"
            )
        if self.events_done is None:  # (a resume has set it: P2RTrainer.rebuild_for_checkpoint)
            plans = self.plans(model)
            done = 0
            while done < len(plans) and plans[done] is None:
                done += 1
            if done:
                logger.warning(
                    f"P2RCallback: the model already has {model.config.num_hidden_layers} layers and "
                    f"{model.config.num_blocks} blocks: the events at steps {self.delink_steps[:done]} are past, "
                    "skipped"
                )
            self.events_done = done
        self.check(model, state.max_steps, self.events_done)
        self.num_hidden_layers, self.num_blocks = model.config.num_hidden_layers, model.config.num_blocks

    def on_step_begin(self, args, state, control, **kwargs):
        while self.events_done < len(self.events) and self.events[self.events_done].step <= state.global_step:
            event = self.events[self.events_done]
            config = self.trainer.model.config
            before = (config.num_hidden_layers, config.num_blocks)
            self.trainer.delink(event_plan(event, config), self.carry)
            config = self.trainer.model.config
            self.events_done += 1
            self.num_hidden_layers, self.num_blocks = config.num_hidden_layers, config.num_blocks
            kind = "grew" if isinstance(event, Grow) else "delinked"
            logger.info(
                f"step {state.global_step}: {kind} {before[0]} layers, {before[1]} blocks -> {self.num_hidden_layers} "
                f"layers, {self.num_blocks} blocks (carry={self.carry}, lr_after_delink={self.lr_after_delink})"
            )
            record = {GROW if isinstance(event, Grow) else DELINK: 1, NUM_BLOCKS_BEFORE: before[1]}
            if isinstance(event, Grow):
                record[NUM_HIDDEN_LAYERS_BEFORE] = before[0]
            self.trainer.log(record)

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What `trainer_state.json` keeps: the schedule (to rebuild this callback) and the model's stage at the
        checkpoint (its depth and blocks: pseudo while fewer blocks than layers, shallow while fewer layers than the
        real depth)."""
        delinks = [[event.step, event.blocks] for event in self.events if isinstance(event, Delink)]
        grows = [
            [event.step, event.num_hidden_layers, event.blocks, event.growth, event.function_preserving]
            for event in self.events
            if isinstance(event, Grow)
        ]
        return {
            "args": {
                "delink_at": delinks or None,
                "growth": grows or None,
                "carry": self.carry,
                "lr_after_delink": self.lr_after_delink,
                "rewarm_steps": self.rewarm_steps,
            },
            "attributes": {"num_hidden_layers": self.num_hidden_layers, "num_blocks": self.num_blocks},
        }


__all__ = [
    "DELINK",
    "GROW",
    "NUM_BLOCKS",
    "NUM_BLOCKS_BEFORE",
    "NUM_HIDDEN_LAYERS",
    "NUM_HIDDEN_LAYERS_BEFORE",
    "Delink",
    "Grow",
    "P2RCallback",
    "event_plan",
    "growth_events",
    "schedule_events",
]
