"""The engines behind the one training loop (`base.Engine`): `AccelerateEngine` (one process, DDP, FSDP2, DeepSpeed,
granular offload) and `PipelineEngine` (pipeline stages, data-parallel pipelines, or the whole model as one stage
sharded over the data-parallel processes). `engine_for` picks one from the configuration and hands it the sections and
values it reads; a new engine is a module here and a line there."""

from pathlib import Path

from ...config import TrainConfig
from ...lazy import lazy_exports
from ..optim import optimizer_factory
from .accelerate import AccelerateEngine
from .base import Engine

# `PipelineEngine` loads on first use: a pipeline's modules (torch.distributed.pipelining's among them) load only
# where a pipeline runs.
__getattr__, __dir__, _ = lazy_exports(__name__, {".pipeline": ("PipelineEngine",)})


def engine_for(config: TrainConfig) -> Engine:
    """The engine that runs `config`: a pipeline when `pipeline_parallel_size > 1` or `data_parallel_size > 1` (the
    whole model one stage, data parallel: FSDP2-sharded with `data_parallel_shard`, on CPU as on GPUs), else
    Accelerate (which reads its own launch configuration: one process, DDP, FSDP2, DeepSpeed). Each engine is given
    its sections (compute, and offload or parallel) and the few values of the others it reads."""
    parallel, saving, report_to = config.parallel, config.checkpointing, config.logging.report_to
    common = dict(
        block_size=config.data.block_size,
        optimizer_factory=optimizer_factory(config.optim),
        max_grad_norm=config.optim.max_grad_norm,
        optimizer_carry=config.stages.optimizer_carry,
        checkpoint_format=saving.checkpoint_format,
        remote_code=saving.remote_code,
        log_with=None if report_to == "none" else report_to,
        project_dir=Path(saving.output_dir),
    )
    if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
        from .pipeline import PipelineEngine

        first, depth = config.initial_blocks(), config.model.num_hidden_layers
        return PipelineEngine(config.compute, parallel, initial_blocks=first, num_hidden_layers=depth, **common)
    return AccelerateEngine(
        config.compute,
        config.offload,
        optimizer=config.optim.optimizer,
        delinks=bool(config.delink_schedule()),
        checkpoint_async=saving.checkpoint_async,
        **common,
    )


__all__ = ["AccelerateEngine", "Engine", "PipelineEngine", "engine_for"]
