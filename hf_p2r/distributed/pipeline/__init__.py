"""Pipeline parallelism for P2R models on `torch.distributed.pipelining`, by role:

- `schedules`: the registry of schedules and their facts (plain Python);
- `split`: where the model is cut into stages, from each piece's costs (plain Python);
- `stage`: the stage module of a P2R model, its parameter names, its loss, FSDP2 on a stage;
- `pipedream`: PipeDream-2BW, the schedule hf-p2r adds to torch's;
- `runtime`: `Pipeline` and `build_pipeline` (schedule, gradient reduction, clipping, checkpoint state);
- `delink`: the delink of this process's stages.

Names load on first use (PEP 562), so that `schedules` and `split` stay importable without torch.
"""

from ...lazy import lazy_exports

# The names callers use; the rest is in the role's module.
__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".schedules": ("SCHEDULES", "get_schedule"),
        ".split": ("balanced_split", "check_split", "explain_split"),
        ".stage": ("P2RPipelineStage", "causal_lm_loss", "model_name"),
        ".pipedream": ("SchedulePipeDream2BW",),
        ".runtime": (
            "Pipeline",
            "build_pipeline",
            "gather_state_dict",
            "load_pipeline_state",
            "pipeline_mesh",
            "pipeline_model_config",
            "pipeline_state",
        ),
        ".delink": ("delink_stages",),
    },
)
