"""Everything distributed, applied to a P2R model from outside it: FSDP2 (`fsdp`), pipeline parallelism (`pipeline`:
the schedule registry, the split, stages, PipeDream-2BW, the runtime, the delink of stages) and the schedule
simulator (`simulate`). This package never imports the trainer (`hf_p2r.training`).

Names load on first use (PEP 562): the registry, the split and the simulator stay importable without torch.
"""

import importlib

_EXPORTS = {
    "delink_fully_sharded": ".fsdp",
    "fully_shard_p2r": ".fsdp",
    "gather_deepspeed_model": ".fsdp",
    "gather_shared_once": ".fsdp",
    "SCHEDULES": ".pipeline.schedules",
    "balanced_split": ".pipeline.split",
    "P2RPipelineStage": ".pipeline.stage",
    "SchedulePipeDream2BW": ".pipeline.pipedream",
    "Pipeline": ".pipeline.runtime",
    "build_pipeline": ".pipeline.runtime",
    "gather_state_dict": ".pipeline.runtime",
    "load_pipeline_state": ".pipeline.runtime",
    "pipeline_state": ".pipeline.runtime",
    "delink_stages": ".pipeline.delink",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
