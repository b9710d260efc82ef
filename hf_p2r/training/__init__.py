"""Pseudo-to-Real training: pseudo stage -> delink -> real stage in one run.

Modules, each readable alone: `config` (the YAML + command-line configuration), `data` (a package: corpus,
documents, tokenizer, packed and streamed blocks), `optim` (AdamW and the learning-rate schedule), `offload` (granular
CPU offload), `carry` (the optimizer state across a delink), `delink` (delinking a model or a pipeline in training),
`resume` (a package, the resume state: atomic checkpoints and model saves, trainer_state.json, DCP shards, the export;
`checkpointing`, `dcp` and `export` are its modules under their old names), `metrics` (metrics.jsonl and the loss
curve), `run` (the step log, the stop on signals, the output folder, the summary), `engines` (how each backend steps,
delinks, evaluates and saves), `train` (the one loop).
"""

from ..config import ConfigError, DataArguments, ModelArguments, TrainArguments, TrainConfig, parse_config
from .delink import delink_in_training, delink_pipeline, delink_with_optimizer
from .run import NonFiniteLossError
from .train import build_model, train

__all__ = [
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "NonFiniteLossError",
    "TrainArguments",
    "TrainConfig",
    "build_model",
    "delink_in_training",
    "delink_pipeline",
    "delink_with_optimizer",
    "parse_config",
    "train",
]
