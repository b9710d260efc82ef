"""The engines behind the one training loop (`base.Engine`): `AccelerateEngine` (one process, DDP, FSDP2, DeepSpeed,
granular offload) and `PipelineEngine` (pipeline stages, data-parallel pipelines, or the whole model as one stage
sharded over the data-parallel processes). `engine_for` picks one from the configuration; a new engine is a module
here and a line there."""

from ...config import TrainConfig
from .accelerate import AccelerateEngine
from .base import Engine
from .pipeline import PipelineEngine


def engine_for(config: TrainConfig) -> Engine:
    """The engine that runs `config`: a pipeline when `pipeline_parallel_size > 1` or `data_parallel_size > 1` (the
    whole model one stage, data parallel: FSDP2-sharded with `data_parallel_shard`, on CPU as on GPUs), else
    Accelerate (which reads its own launch configuration: one process, DDP, FSDP2, DeepSpeed)."""
    parallel = config.parallel
    if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
        return PipelineEngine(config)
    return AccelerateEngine(config)


__all__ = ["AccelerateEngine", "Engine", "PipelineEngine", "engine_for"]
