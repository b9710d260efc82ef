"""Lazy, validated reading of safetensors checkpoints: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`.

Tensors come back memory-mapped: opening a checkpoint of any size costs no RAM, and a tensor's pages are read (into
the page cache, not anonymous memory) only when something touches them.
"""

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .headers import DTYPE_NAMES, read_weights


class CheckpointReader:
    """Read-only, memory-mapped view of the safetensors weights in `folder`.

    Every file is opened and validated up front: headers that do not describe the file (truncated, corrupt, lying
    shapes or offsets), an index naming a missing shard or a tensor its shard does not hold, and shards holding tensors
    the index does not list all raise `ValueError` / `FileNotFoundError` naming the file and the problem.

    ```python
    >>> with CheckpointReader("pseudo_dir") as reader:
    ...     embed = reader.get("model.embed_tokens.weight")   # mmapped, no copy
    ```
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._file_of = {name: info.file.name for name, info in read_weights(self.folder).items()}  # checks it all
        self._handles = {}
        try:
            for file in sorted(set(self._file_of.values())):
                self._handles[file] = _open(self.folder / file)
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    @property
    def files(self) -> list[Path]:
        """The safetensors files (index excluded)."""
        return [self.folder / file for file in self._handles]

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        return self.folder / self._file_of[name]

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`, memory-mapped on CPU (read-only in practice: never write to it)."""
        return self._handles[self._file_of[name]].get_tensor(name)

    def info(self, name: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of tensor `name`, from its file's header: unlike `get`, touches none of its data (getting a
        tensor maps part of its pages, which for a whole checkpoint adds up)."""
        view = self._handles[self._file_of[name]].get_slice(name)
        return torch.Size(view.get_shape()), getattr(torch, DTYPE_NAMES[view.get_dtype()])

    def close(self) -> None:
        """Close the files; tensors already returned stay valid."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: Path):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as error:  # what `read_weights` does not check
        raise ValueError(f"{path}: not a valid safetensors file: {error}") from None
