"""The trainer's configuration lives in `hf_p2r.config` (torch-free, so that `--help` and configuration errors answer
at once); this module keeps the names it had for code written against it."""

from ..config import (
    MAX_CONFIG_BYTES,
    MOE_FIELDS,
    ConfigError,
    DataArguments,
    ModelArguments,
    TrainArguments,
    TrainConfig,
    even_delink_steps,
    offload_text,
    parse_config,
    parse_offload,
)

__all__ = [
    "MAX_CONFIG_BYTES",
    "MOE_FIELDS",
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "TrainArguments",
    "TrainConfig",
    "even_delink_steps",
    "offload_text",
    "parse_config",
    "parse_offload",
]
