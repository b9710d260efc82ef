"""Checkpoint I/O: every safetensors read and write of hf-p2r goes through this package.

- `CheckpointReader`: lazy, validated, memory-mapped reading (one file or shards + index).
- `write_checkpoint`: sharded writing with constant anonymous memory (tensors written from where they live).
- `convert_pseudo_to_real`, `export_llama`: folder-to-folder conversions built on those two.
- `save_model`: an in-memory model saved as a checkpoint folder (the trainer's saves, `export_llama` of a model).
- `atomic_directory`: outputs appear complete or not at all.
"""

from .convert import convert_pseudo_to_real, read_p2r_config, verify_checkpoint
from .io import atomic_directory, read_config_dict
from .llama import export_llama, llama_config
from .reader import CheckpointReader
from .save import save_model
from .writer import write_checkpoint

__all__ = [
    "CheckpointReader",
    "atomic_directory",
    "convert_pseudo_to_real",
    "export_llama",
    "llama_config",
    "read_config_dict",
    "read_p2r_config",
    "save_model",
    "verify_checkpoint",
    "write_checkpoint",
]
