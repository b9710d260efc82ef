"""Checkpoint I/O: every safetensors read and write of hf-p2r goes through this package.

- `CheckpointReader`: lazy, validated, memory-mapped reading (one file or shards + index).
- `write_checkpoint`: sharded writing with constant anonymous memory (tensors written from where they live).
- `convert_pseudo_to_real`, `export_llama`: folder-to-folder conversions; they plan from headers (`headers.py`) and
  copy byte ranges in the kernel (`ranges.py`), without torch unless a dtype cast needs it; what a checkpoint can be
  written as (P2R, Llama, Mixtral) is the registry `targets.TARGETS`.
- `render_model_card`: the model card of a checkpoint folder (`card.py`; `hf_p2r.hub` pushes it).
- `save_model`: an in-memory model saved as a checkpoint folder (the trainer's saves, `export_llama` of a model);
  `save_model_from_shards`: the same folder written by the processes that hold the model in pieces (pipeline stages,
  FSDP2 shards), each its own tensors' bytes, no process holding the whole state dict.
- `atomic_directory`: outputs appear complete or not at all.

Names load on first use (PEP 562), so that the torch-free modules stay torch-free.
"""

from ..lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".card": ("render_model_card",),
        ".convert": ("convert_pseudo_to_real",),
        ".io": ("atomic_directory", "file_within", "files_within", "read_config_dict"),
        ".llama": ("export_llama", "llama_config"),
        ".mixtral": ("export_mixtral", "mixtral_config"),
        ".reader": ("CheckpointReader",),
        ".save": ("save_model",),
        ".sharded_write": ("save_model_from_shards",),
        ".source": ("read_p2r_config",),
        ".verify": ("verify_checkpoint",),
        ".writer": ("write_checkpoint",),
    },
)
