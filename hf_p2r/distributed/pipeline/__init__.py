"""Pipeline parallelism for P2R models on `torch.distributed.pipelining`, by role:

- `schedules`: the registry of schedules and their facts (plain Python);
- `split`: where the model is cut into stages, from each piece's costs (plain Python);
- `stage`: the stage module of a P2R model, its parameter names, its loss, FSDP2 on a stage;
- `pipedream`: PipeDream-2BW, the schedule hf-p2r adds to torch's;
- `runtime`: `Pipeline` and `build_pipeline` (schedule, gradient reduction, clipping, checkpoint state);
- `delink`: the delink of this process's stages.

Names load on first use (PEP 562), so that `schedules` and `split` stay importable without torch.
"""

import importlib

_EXPORTS = {
    "ONE_STAGE_SCHEDULES": ".schedules",
    "SCHEDULES": ".schedules",
    "PipelineSchedule": ".schedules",
    "get_schedule": ".schedules",
    "PieceCost": ".split",
    "allowed_cuts": ".split",
    "balanced_split": ".split",
    "check_split": ".split",
    "explain_split": ".split",
    "piece_costs": ".split",
    "stage_cost": ".split",
    "stage_depths": ".split",
    "P2RPipelineStage": ".stage",
    "causal_lm_loss": ".stage",
    "model_name": ".stage",
    "shard_stage": ".stage",
    "SchedulePipeDream2BW": ".pipedream",
    "FlushSchedule": ".runtime",
    "Pipeline": ".runtime",
    "build_pipeline": ".runtime",
    "gather_state_dict": ".runtime",
    "load_pipeline_state": ".runtime",
    "pipeline_mesh": ".runtime",
    "pipeline_model_config": ".runtime",
    "pipeline_state": ".runtime",
    "delink_stages": ".delink",
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
