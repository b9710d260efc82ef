"""Pseudo-to-Real training with Accelerate: pseudo stage -> delink -> real stage in one run.

Modules, each readable alone: `config` (the YAML + command-line configuration), `data` (corpus, tokenizer, packed
blocks), `optim` (AdamW and the learning-rate schedule), `delink` (delinking a model in training and carrying its
optimizer state), `checkpointing` (atomic checkpoints and model saves), `metrics` (metrics.jsonl and the loss
curve), `train` (the run).
"""

from .config import ConfigError, DataArguments, ModelArguments, TrainArguments, TrainConfig, parse_config
from .delink import delink_in_training, delink_with_optimizer
from .train import NonFiniteLossError, build_model, train

__all__ = [
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "NonFiniteLossError",
    "TrainArguments",
    "TrainConfig",
    "build_model",
    "delink_in_training",
    "delink_with_optimizer",
    "parse_config",
    "train",
]
