"""Checkpoint I/O: every safetensors read and write of hf-p2r goes through this package."""

from .io import atomic_directory
from .llama import export_llama, llama_config

__all__ = ["atomic_directory", "export_llama", "llama_config"]
