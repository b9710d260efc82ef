"""Checkpoint I/O: every safetensors read and write of hf-p2r goes through this package.

- `CheckpointReader`: lazy, validated, memory-mapped reading (one file or shards + index).
- `write_checkpoint`: sharded writing with constant anonymous memory (tensors written from where they live).
- `convert_pseudo_to_real`, `export_llama`: folder-to-folder conversions; they plan from headers (`headers.py`) and
  copy byte ranges in the kernel (`ranges.py`), without torch unless a dtype cast needs it; what a checkpoint can be
  written as (P2R, Llama, Mixtral) is the registry `targets.TARGETS`.
- `render_model_card`: the model card of a checkpoint folder (`card.py`; `hf_p2r.hub` pushes it).
- `save_model`: an in-memory model saved as a checkpoint folder (the trainer's saves, `export_llama` of a model).
- `atomic_directory`: outputs appear complete or not at all.

Names load on first use (PEP 562), so that the torch-free modules stay torch-free.
"""

import importlib

_EXPORTS = {
    "CheckpointReader": ".reader",
    "atomic_directory": ".io",
    "convert_pseudo_to_real": ".convert",
    "export_llama": ".llama",
    "export_mixtral": ".mixtral",
    "file_within": ".io",
    "files_within": ".io",
    "llama_config": ".llama",
    "mixtral_config": ".mixtral",
    "read_config_dict": ".io",
    "read_p2r_config": ".convert",
    "render_model_card": ".card",
    "save_model": ".save",
    "verify_checkpoint": ".convert",
    "write_checkpoint": ".writer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
