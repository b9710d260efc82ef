"""`P2RCallback`: when a P2R model delinks inside transformers' `Trainer` (or TRL's trainers, which subclass it), how
its optimizer state starts (the carry) and how the learning rate goes on.

The schedule is an ordered list of events (`Delink` today; depth growth, issue 39, adds its own kind to the same
list). The callback checks it against the model when training begins, calls the trainer's `delink` at the start of
each scheduled step (`P2RTrainer`, `hf_p2r.integrations.trainer`: transformers' Trainer builds its model, optimizer
and scheduler once, so the swap itself needs the trainer), and records the model's stage in every checkpoint's
`trainer_state.json` (an `ExportableState`: `stateful_callbacks.P2RCallback.attributes.num_blocks`).

```python
callback = P2RCallback(delink_at={100: 2, 200: 4, 300: None}, carry="scale")  # 1 -> 2 -> 4 blocks -> real
```
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..models.p2r import delink_sources
from ..training.carry import CARRIES

logger = logging.getLogger(__name__)

LR_AFTER_DELINK = ("continue", "rewarm")
# The values every log record gets (`P2RTrainer.log`) and the delink's record adds; numbers only, so that every
# `report_to` integration (TensorBoard, W&B, MLflow, ...) takes them as scalars.
NUM_BLOCKS = "p2r/num_blocks"
DELINK = "p2r/delink"
NUM_BLOCKS_BEFORE = "p2r/num_blocks_before"


@dataclass(frozen=True)
class Delink:
    """At the start of optimizer step `step` (after `step` updates, as `TrainerState.global_step` counts them) the
    model is delinked to `blocks` blocks (None: the real model, every layer its own block)."""

    step: int
    blocks: int | None = None


def schedule_events(delink_at) -> list[Delink]:
    """The ordered events of `delink_at`: a step (one delink to the real model), {step: blocks after it (None: the
    real model)}, or a sequence of `Delink` events or (step, blocks) pairs. `ValueError` naming `delink_at` for
    anything else, for steps that are not positive and increasing, and for block counts that do not grow."""
    if isinstance(delink_at, int) and not isinstance(delink_at, bool):
        pairs = [(delink_at, None)]
    elif isinstance(delink_at, Mapping):
        pairs = sorted(delink_at.items(), key=lambda item: item[0] if isinstance(item[0], int) else 0)
    elif isinstance(delink_at, Sequence) and not isinstance(delink_at, str):
        pairs = [
            (e.step, e.blocks) if isinstance(e, Delink) else tuple(e) if _is_pair(e) else (e, "?") for e in delink_at
        ]
    else:
        raise ValueError(
            "delink_at: give a step (int), {step: blocks after it, None for the real model}, or a list of Delink "
            f"events; got {type(delink_at).__name__}"
        )
    if not pairs:
        raise ValueError("delink_at: the schedule is empty; give at least the step of the delink to the real model")
    events, previous_step, previous_blocks = [], 0, 1
    for index, (step, blocks) in enumerate(pairs):
        if isinstance(step, bool) or not isinstance(step, int) or step <= previous_step:
            raise ValueError(f"delink_at: steps must be integers >= 1, increasing; got {step!r} after {previous_step}")
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


def _is_pair(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2


class P2RCallback(TrainerCallback, ExportableState):
    """Delink a P2R model at scheduled steps of a `Trainer` run (use it with `P2RTrainer`, or `p2r_trainer(cls)` for a
    Trainer subclass such as TRL's `SFTTrainer`).

    Args:
        delink_at: when the model delinks: a step (to the real model), {step: blocks after it} with None for the
            real model (partial delinks, e.g. {100: 2, 200: 4, 300: None}), or a list of `Delink` events.
        carry: how the optimizer state of the new blocks starts: `reset` (fresh), `copy` (the shared block's moments),
            `scale` (the moments times n'/n, the squared ones times (n'/n)^2; n, n': the depths a block ran at before
            and after). Parameters outside the blocks keep their state in every mode (`hf_p2r.training.carry`).
        lr_after_delink: `continue` the learning-rate schedule where it is, or `rewarm` it: the rate times
            (steps since the delink + 1) / `rewarm_steps` for `rewarm_steps` steps after each delink.
        rewarm_steps: the length of the rewarm.
    """

    def __init__(self, delink_at, carry: str = "scale", lr_after_delink: str = "continue", rewarm_steps: int = 20):
        self.events = schedule_events(delink_at)
        if carry not in CARRIES:
            raise ValueError(f"carry: {carry!r} is not one of {', '.join(CARRIES)}")
        if lr_after_delink not in LR_AFTER_DELINK:
            raise ValueError(f"lr_after_delink: {lr_after_delink!r} is not one of {', '.join(LR_AFTER_DELINK)}")
        if isinstance(rewarm_steps, bool) or not isinstance(rewarm_steps, int) or rewarm_steps < 1:
            raise ValueError(f"rewarm_steps: must be an integer >= 1, got {rewarm_steps!r}")
        self.carry, self.lr_after_delink, self.rewarm_steps = carry, lr_after_delink, rewarm_steps
        self.num_blocks: int | None = None  # the model's blocks now (set when training begins; in checkpoints)
        self.trainer = None  # the P2RTrainer that runs the delinks (it binds itself)

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
        return [event.step for event in self.events]

    def target_blocks(self, event: Delink, depth: int) -> int:
        return depth if event.blocks is None else event.blocks

    def check(self, model, max_steps: int) -> None:
        """Refuse, in one line, a schedule this model or run cannot follow: a model that is not a P2R model, a
        transition `delink` refuses (`delink_sources`), an event at or after the run's last step."""
        config = getattr(model, "config", None)
        if not hasattr(model, "delink_parameter_map") or not hasattr(config, "num_blocks"):
            raise ValueError(
                f"model: P2RCallback delinks a P2R model (hf_p2r.P2RForCausalLM, P2RMoeForCausalLM), got "
                f"{type(model).__name__}"
            )
        depth, blocks = config.num_hidden_layers, config.num_blocks
        for event in self.events:
            target = self.target_blocks(event, depth)
            if target <= blocks:
                continue
            try:
                delink_sources(depth, blocks, target, config.sharing_pattern)
            except ValueError as error:
                raise ValueError(f"delink_at: step {event.step}: {error}") from None
            if max_steps > 0 and event.step >= max_steps:
                raise ValueError(
                    f"delink_at: step {event.step} is at or after the run's end (max_steps {max_steps}): the delink "
                    "would never run"
                )
            blocks = target

    # --- events --------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "P2RCallback: transformers' Trainer cannot swap its model from a callback; train with "
                "hf_p2r.integrations.P2RTrainer, or p2r_trainer(YourTrainerClass) for a subclass (TRL's SFTTrainer)"
            )
        self.check(model, state.max_steps)
        self.num_blocks = model.config.num_blocks

    def on_step_begin(self, args, state, control, **kwargs):
        depth = self.trainer.model.config.num_hidden_layers
        for event in self.events:
            target = self.target_blocks(event, depth)
            if event.step <= state.global_step and target > self.num_blocks:
                before = self.num_blocks
                self.trainer.delink(event.blocks, self.carry)
                self.num_blocks = target
                logger.info(
                    f"step {state.global_step}: delinked {before} -> {target} blocks (carry={self.carry}, "
                    f"lr_after_delink={self.lr_after_delink})"
                )
                self.trainer.log({DELINK: 1, NUM_BLOCKS_BEFORE: before})

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What `trainer_state.json` keeps: the schedule (to rebuild this callback) and the model's blocks at the
        checkpoint (its stage: pseudo while fewer than the model's layers)."""
        return {
            "args": {
                "delink_at": [[event.step, event.blocks] for event in self.events],
                "carry": self.carry,
                "lr_after_delink": self.lr_after_delink,
                "rewarm_steps": self.rewarm_steps,
            },
            "attributes": {"num_blocks": self.num_blocks},
        }


__all__ = ["DELINK", "NUM_BLOCKS", "NUM_BLOCKS_BEFORE", "Delink", "P2RCallback", "schedule_events"]
