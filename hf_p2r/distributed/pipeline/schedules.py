"""The pipeline schedules hf-p2r runs and what each one is: the one registry that the trainer's `pipeline_schedule`
choices, the runtime (`build_pipeline`), the simulator (`hf_p2r.distributed.simulate`) and the planner read.

Plain Python (no torch): the planner and the simulator import it without the runtime.

```python
>>> from hf_p2r.distributed.pipeline.schedules import SCHEDULES, get_schedule
>>> SCHEDULES
('gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', '2bw')
>>> get_schedule("2bw").weight_versions, get_schedule("interleaved_1f1b").virtual_stages
(2, True)
```

A schedule new to hf-p2r is one entry here (and, if torch does not have it, a class beside `pipedream.py`).
"""

from dataclasses import dataclass

# Stages per process of an interleaved schedule as hf-p2r runs it (the trainer's pipelines, the planner, the checks of
# a manual pipeline_split).
VIRTUAL_STAGES = 2


@dataclass(frozen=True)
class PipelineSchedule:
    """What one pipeline schedule is; every other module derives its behaviour from these fields (the defaults are
    torch's 1F1B-like flush schedules' answers)."""

    name: str  # the trainer's `pipeline_schedule` value
    title: str  # how messages name it
    torch_name: str | None  # torch.distributed.pipelining's `get_schedule_class` name; None: hf-p2r's own (2bw)
    virtual_stages: bool = False  # several stages per process (interleaved), else one
    weight_versions: int = 1  # weight copies a stage keeps in a pipeline (2BW: the newest and the one in flight)
    microbatches_at_least_stages: bool = False  # needs m >= d micro-batches per step (d: a pipeline's processes)
    why_microbatches: str = ""  # what fewer than d micro-batches would break
    flush: bool = True  # each optimizer step ends with a flush (a bubble of (d - 1) / (m + d - 1)); 2BW streams steps
    holds_every_microbatch: bool = False  # a stage keeps every micro-batch's activations (GPipe), else at most d - s
    updates_inside: bool = False  # the schedule reduces, clips and steps the optimizer itself (2BW's delayed update)
    shard_refusal: str = ""  # why FSDP2-sharded stages (data_parallel_shard) are refused; "": they are allowed

    def check_microbatches(self, microbatches: int, stages: int) -> None:
        """The m >= d rule, the one place it is checked: `ValueError` naming `num_microbatches` if it is broken."""
        if self.microbatches_at_least_stages and microbatches < stages:
            raise ValueError(
                f"num_microbatches: {self.title} needs at least pipeline_parallel_size micro-batches per optimizer "
                f"step: num_microbatches ({microbatches}) must be at least the pipeline depth ({stages}); "
                f"{self.why_microbatches}"
            )

    def check_shardable(self) -> None:
        """`ValueError` naming `data_parallel_shard` if this schedule cannot run FSDP2-sharded stages."""
        if self.shard_refusal:
            raise ValueError(
                f"data_parallel_shard: not supported with pipeline_parallel_size > 1 ({self.title} "
                f"{self.shard_refusal}; use replicated data-parallel stages: data_parallel_shard: false)"
            )

    def check_one_stage(self, pipeline_parallel_size: int) -> None:
        """Without a pipeline (`pipeline_parallel_size` 1: the whole model one stage, data parallel over the processes)
        a schedule runs the micro-batches of one stage one after the other: gradient accumulation. 1F1B (one
        micro-batch's activations at a time) and GPipe (all of them) do; a schedule of several stages per process or
        of delayed updates (2BW: the delay only hides a pipeline's bubble) has nothing to run. `ValueError` naming
        `pipeline_schedule`."""
        if pipeline_parallel_size != 1 or not (self.virtual_stages or not self.flush):
            return
        why = "runs several stages per process" if self.virtual_stages else "delays the update to hide the bubble"
        raise ValueError(
            f"pipeline_schedule: {self.title} {why} of a pipeline, which pipeline_parallel_size 1 (the whole model one "
            "stage) does not have; use 1f1b (or gpipe)"
        )

    def stages_per_process(self, virtual_stages: int = VIRTUAL_STAGES) -> int:
        """Stages a process runs: `virtual_stages` under an interleaved schedule, else one."""
        return virtual_stages if self.virtual_stages else 1

    def versions(self, stages: int) -> int:
        """Copies of its weights a stage of a `stages`-deep pipeline holds (one without a pipeline)."""
        return self.weight_versions if stages > 1 else 1

    def in_flight(self, stages: int, stage: int, microbatches: int) -> int:
        """Micro-batches whose activations stage `stage` of `stages` holds at once, at most (one stage runs them one
        after the other, whatever the schedule: `runtime.AccumulateSchedule`)."""
        return microbatches if self.holds_every_microbatch and stages > 1 else min(stages - stage, microbatches)

    def bubble(self, stages: int, microbatches: int) -> float:
        """Idle share of a step with equal stages and free communication: (d - 1) / (m + d - 1) for a flush, none
        for a schedule that streams its steps (in steady state the next batch's forwards fill the drain)."""
        if stages == 1 or not self.flush:
            return 0.0
        return (stages - 1) / (microbatches + stages - 1)


_REGISTRY = (
    PipelineSchedule("gpipe", "GPipe", "GPipe", holds_every_microbatch=True),
    PipelineSchedule(
        "1f1b", "1F1B", "1F1B", microbatches_at_least_stages=True, why_microbatches="torch's Schedule1F1B refuses fewer"
    ),
    PipelineSchedule("interleaved_1f1b", "interleaved 1F1B", "Interleaved1F1B", virtual_stages=True),
    PipelineSchedule("zero_bubble", "interleaved zero bubble", "InterleavedZeroBubble", virtual_stages=True),
    PipelineSchedule(
        "2bw",
        "PipeDream-2BW",
        None,
        weight_versions=2,
        microbatches_at_least_stages=True,
        why_microbatches="with fewer, more than two weight versions would be in flight",
        flush=False,
        updates_inside=True,
        shard_refusal="swaps two weight versions in the stage, which FSDP2's sharded parameters do not allow",
    ),
)
REGISTRY: dict[str, PipelineSchedule] = {schedule.name: schedule for schedule in _REGISTRY}
# The trainer's `pipeline_schedule` values.
SCHEDULES: tuple[str, ...] = tuple(REGISTRY)
# One stage per process: the schedules the simulator writes action lists for and the planner sizes.
ONE_STAGE_SCHEDULES: tuple[str, ...] = tuple(name for name, spec in REGISTRY.items() if not spec.virtual_stages)


def get_schedule(name: str) -> PipelineSchedule:
    """The registry's entry for `name`; `ValueError` naming `pipeline_schedule` for an unknown one."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"pipeline_schedule: {name!r} is not one of {', '.join(SCHEDULES)}") from None


__all__ = ["ONE_STAGE_SCHEDULES", "REGISTRY", "SCHEDULES", "VIRTUAL_STAGES", "PipelineSchedule", "get_schedule"]
