"""Everything distributed, applied to a P2R model from outside it: FSDP2 (`fsdp`), pipeline parallelism (`pipeline`:
stages, split, torch's schedules, the delink in a pipeline) and PipeDream-2BW (`pipedream`)."""

from .fsdp import delink_fully_sharded, fully_shard_p2r, gather_deepspeed_model, gather_shared_once
from .pipedream import SchedulePipeDream2BW
from .pipeline import (
    SCHEDULES,
    P2RPipelineStage,
    Pipeline,
    balanced_split,
    build_pipeline,
    delink_pipeline,
    gather_state_dict,
    load_pipeline_state,
    pipeline_state,
)

__all__ = [
    "SCHEDULES",
    "P2RPipelineStage",
    "Pipeline",
    "SchedulePipeDream2BW",
    "balanced_split",
    "build_pipeline",
    "delink_fully_sharded",
    "delink_pipeline",
    "fully_shard_p2r",
    "gather_deepspeed_model",
    "gather_shared_once",
    "gather_state_dict",
    "load_pipeline_state",
    "pipeline_state",
]
