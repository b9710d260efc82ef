"""Everything distributed, applied to a P2R model from outside it: FSDP2 (`fsdp`), DeepSpeed ZeRO-3 (`deepspeed`),
pipeline parallelism (`pipeline`: the schedule registry, the split, stages, PipeDream-2BW, the runtime, the delink of
stages), meta-device construction (`materialize`) and the schedule simulator (`simulate`). This package never imports
the trainer (`hf_p2r.training`).

Names load on first use (PEP 562): the registry, the split and the simulator stay importable without torch.
"""

from ..lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".fsdp": ("delink_fully_sharded", "fully_shard_p2r", "gather_shared_once"),
        ".deepspeed": ("delink_deepspeed", "gather_deepspeed_model", "materialize_zero3"),
        ".pipeline.schedules": ("SCHEDULES",),
        ".pipeline.split": ("balanced_split",),
        ".pipeline.stage": ("P2RPipelineStage",),
        ".pipeline.pipedream": ("SchedulePipeDream2BW",),
        ".pipeline.runtime": (
            "Pipeline",
            "build_pipeline",
            "gather_state_dict",
            "load_pipeline_state",
            "pipeline_state",
        ),
        ".pipeline.delink": ("delink_stages",),
    },
)
