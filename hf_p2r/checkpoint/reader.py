"""Lazy, validated reading of safetensors checkpoints: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`.

Tensors come back memory-mapped: opening a checkpoint of any size costs no RAM, and a tensor's pages are read (into
the page cache, not anonymous memory) only when something touches them.
"""

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import _getdtype
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

# Bytes per element of safetensors' dtype codes, to explain a header that safetensors rejects.
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_DTYPE_BYTES.update(dict.fromkeys(("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "BOOL"), 1))


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
        index_path = self.folder / SAFE_WEIGHTS_INDEX_NAME
        if index_path.is_file():
            weight_map = _read_index(index_path)
        elif (self.folder / SAFE_WEIGHTS_NAME).is_file():
            weight_map = None
        else:
            others = sorted(
                p.name for p in self.folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".safetensors")
            )
            hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
            raise FileNotFoundError(f"{self.folder}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}{hint}")

        files = sorted(set(weight_map.values())) if weight_map else [SAFE_WEIGHTS_NAME]
        self._handles = {}
        try:
            for file in files:
                path = self.folder / file
                if not path.is_file():
                    raise FileNotFoundError(f"{index_path}: names shard {file}, which does not exist in {self.folder}")
                self._handles[file] = _open(path)
            if weight_map:
                self._check_index(index_path, weight_map)
        except BaseException:
            self.close()
            raise
        self._file_of = weight_map or dict.fromkeys(self._handles[SAFE_WEIGHTS_NAME].keys(), SAFE_WEIGHTS_NAME)

    def _check_index(self, index_path: Path, weight_map: dict[str, str]) -> None:
        for file, handle in self._handles.items():
            stored = set(handle.keys())
            listed = {name for name, shard in weight_map.items() if shard == file}
            if missing := sorted(listed - stored):
                raise ValueError(
                    f"{index_path}: lists {_some(missing)} in {file}, but {self.folder / file} does not contain it"
                )
            if extra := sorted(stored - listed):
                raise ValueError(f"{self.folder / file}: holds {_some(extra)}, which {index_path.name} does not list")

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
        return torch.Size(view.get_shape()), _getdtype(view.get_dtype())

    def close(self) -> None:
        """Close the files; tensors already returned stay valid."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{index_path}: not a safetensors index (expected JSON with a 'weight_map'): {error}"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()) or not weight_map:
        raise ValueError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    if bad := sorted({file for file in weight_map.values() if Path(file).name != file}):
        raise ValueError(f"{index_path}: shard names must be plain file names, got {bad[0]!r}")
    return weight_map


def _open(path: Path):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(f"{path}: not a valid safetensors file: {_explain(path) or error}") from None


def _explain(path: Path) -> str | None:
    """Say what is wrong with a file safetensors rejected (safetensors' own message names neither file nor tensor)."""
    size = path.stat().st_size
    if size < 8:
        return f"the file has {size} bytes, less than the 8-byte header length (empty or truncated)"
    with open(path, "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        if 8 + header_len > size:
            return f"its header length ({header_len} bytes) runs past the end of the file ({size} bytes): truncated?"
        try:
            header = json.loads(file.read(header_len))
        except ValueError:
            return "its header is not valid JSON"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * _DTYPE_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            return None  # unusual entry: safetensors' own message is the best we have
        if stop - begin != nbytes:
            return (
                f"tensor {name!r}: shape {info['shape']} of {info['dtype']} needs {nbytes} bytes but its data_offsets "
                f"[{begin}, {stop}] hold {stop - begin}"
            )
        end = max(end, stop)
    data_size = size - 8 - header_len
    if end > data_size:
        return f"its header describes {end} bytes of tensor data but the file holds {data_size}: truncated?"
    if end < data_size:
        return f"{data_size - end} bytes after the last tensor the header describes"
    return None


def _some(names: list[str]) -> str:
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more
