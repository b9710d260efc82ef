"""What a DCP checkpoint's `.metadata` may say, checked before anything is read through it.

A torch.distributed.checkpoint (DCP) folder holds `.metadata` (a pickle: each tensor's shape and dtype, the pieces it
was saved in, and where each piece lies: a file of the folder, a byte offset and a length) and the files of the
pieces (`__0_0.distcp`...). DCP reads whatever `.metadata` says: a piece in `../checkpoint-4/__0_0.distcp` or in
`/etc/...`, and a tensor its pieces cover only in part (what they leave out stays as the memory it was loaded into
held). `read_dcp_metadata` refuses such a checkpoint in one line naming the file and the problem, before anything is
loaded: every path `.metadata` names must be a plain relative path to a regular file within the folder (no `..`, not
absolute, no link out of it: `io.file_within`) long enough for its pieces, and every tensor's pieces must tile it
exactly (no gap, no overlap, each inside its shape, each with its storage entry: `tiling_problem`). `.metadata` is
unpickled naming only DCP's records (`compat.dcp_reader`); whatever those records hold is checked here field by field.

`CoveringLoadPlanner` makes the same promise at the load itself: it is DCP's default planner, which refuses, before
any byte is read, a plan that would leave part of a tensor it loads into unwritten. Every DCP load of hf-p2r (a
resume, `hf-p2r export`) goes through it, so no tensor made with `torch.empty` reaches a model or a writer
uninitialised.

```python
>>> metadata = read_dcp_metadata("run/checkpoints/checkpoint-200")   # InputError naming the problem, if any
>>> dcp.load(state, storage_reader=dcp_reader(folder), planner=CoveringLoadPlanner())
```
"""

import io
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ..compat import dcp_reader
from ..errors import InputError, printable
from .io import file_within, why_skipped

METADATA = ".metadata"  # DCP's index of a checkpoint's tensors and of where their pieces are
_SHOWN = 120  # characters of a key or a path a message quotes


def read_dcp_metadata(folder: str | os.PathLike, *, bytes_entries: bool = False) -> Metadata:
    """The checked `.metadata` of DCP checkpoint `folder`; `InputError` naming the file and the first problem: no
    `.metadata`, or one that is not a regular file within `folder`, does not unpickle to DCP's records, names a file
    outside `folder` (or that is missing, not a regular file, shorter than its pieces), or describes a tensor its pieces
    do not tile exactly. Nothing but `.metadata` is read (the pieces' files are only looked at: kind and size).

    hf-p2r's own DCP checkpoints hold tensors only. `bytes_entries` allows the pickled values another library's DCP
    folder holds (Accelerate's FSDP optimizer state: its parameter groups), which DCP loads with
    `torch.load(weights_only=False)`: each is then read and refused unless `torch.load(weights_only=True)` loads it
    (tensors and plain containers only), so that such a folder runs no code when that library loads it."""
    folder = Path(folder)
    path = folder / METADATA
    if not os.path.lexists(path):
        raise InputError(f"{folder}: not a DCP checkpoint (no {METADATA})")
    if file_within(folder, path) is None:
        raise InputError(f"{path}: refused: {why_skipped(folder, path)}")
    try:
        metadata = dcp_reader(folder, bytes_entries=bytes_entries).read_metadata()
    except Exception as error:  # noqa: BLE001 - a pickle that does not load: EOFError, UnpicklingError, ...
        raise InputError(f"{path}: damaged ({type(error).__name__}: {printable(_first_line(error), 300)})") from None
    problem = _structure_problem(metadata) or _tensors_problem(metadata)
    if problem is not None:
        raise InputError(f"{path}: {problem}")
    _check_files(folder, metadata)
    if bytes_entries:
        _check_bytes(folder, metadata)
    return metadata


def tiling_problem(shape: Sequence[int], pieces: Iterable[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """What is wrong with `pieces` ((offsets, sizes) boxes) as a tiling of a tensor of `shape`, in a few words, or
    None when they cover every element exactly once: a piece of another number of dimensions, one reaching outside
    `shape`, a gap, an overlap. Empty pieces (a size of 0) are allowed anywhere inside `shape`.

    ```python
    >>> tiling_problem((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]) is None
    True
    >>> tiling_problem((4, 2), [((0, 0), (2, 2))])
    'its pieces cover 4 of its 8 elements'
    ```
    """
    shape = tuple(shape)
    boxes, covered = [], 0
    for offsets, sizes in pieces:
        offsets, sizes = tuple(offsets), tuple(sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return (
                f"a piece at {list(offsets)} of size {list(sizes)} does not have the tensor's {len(shape)} dimensions"
            )
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return f"a piece at {list(offsets)} of size {list(sizes)} reaches outside its shape {list(shape)}"
        volume = math.prod(sizes)
        if volume:
            boxes.append((offsets, sizes))
            covered += volume
    total = math.prod(shape)
    if covered < total:
        return f"its pieces cover {covered} of its {total} elements"
    overlap = _overlap(boxes)
    if overlap is not None:
        (a, a_sizes), (b, b_sizes) = overlap
        return f"its pieces at {list(a)} (size {list(a_sizes)}) and {list(b)} (size {list(b_sizes)}) overlap"
    if covered > total:  # (only overlapping pieces can add up to more than the tensor)
        return f"its pieces hold {covered} elements, it has {total}"
    return None


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """Two of `boxes` that share an element, or None: a sweep along the dimension where their offsets differ most
    (the one the tensor was split along), so that a tensor split in N pieces costs about N comparisons."""
    if len(boxes) < 2:
        return None
    if not boxes[0][0]:  # a scalar: any two non-empty pieces are the same element
        return boxes[0], boxes[1]
    axis = max(range(len(boxes[0][0])), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    ordered = sorted(boxes, key=lambda box: box[0][axis])
    for i, (a, a_sizes) in enumerate(ordered):
        for b, b_sizes in ordered[i + 1 :]:
            if b[axis] >= a[axis] + a_sizes[axis]:
                break
            if all(x < y + ys and y < x + xs for x, xs, y, ys in zip(a, a_sizes, b, b_sizes, strict=True)):
                return (a, a_sizes), (b, b_sizes)
    return None


class CoveringLoadPlanner(DefaultLoadPlanner):
    """DCP's `DefaultLoadPlanner`, which also refuses (`ValueError` naming the tensor) a plan that would leave part of
    a tensor it loads into unwritten or write part of it twice: each tensor of the state dict (this process's part of
    a DTensor) must be tiled by the pieces the plan reads into it. Checked when the plan is made, before any byte is
    read."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        reads = defaultdict(list)
        for item in plan.items:
            reads[item.dest_index.fqn].append((item.dest_offsets, item.lengths))
        for fqn, value in self.state_dict.items():
            if isinstance(value, DTensor):
                if value.device_mesh.get_coordinate() is None:  # not on this process's mesh: DCP reads none of it
                    continue
                value = value.to_local()
            if not isinstance(value, torch.Tensor):
                continue
            problem = _reads_problem(value.shape, reads.get(fqn, []))
            if problem is not None:
                raise ValueError(f"{printable(fqn, _SHOWN)}: not wholly in the checkpoint: {problem}")
        return plan


def _reads_problem(shape: torch.Size, reads: list) -> str | None:
    """`tiling_problem` of what a plan reads into a tensor of `shape` (this process's part of it); the pieces' offsets
    are within that part."""
    return tiling_problem(shape, [(tuple(offsets), tuple(lengths)) for offsets, lengths in reads])


# --- the checks of read_dcp_metadata --------------------------------------------------------------------------------
def _structure_problem(metadata) -> str | None:
    """What in the unpickled records is not what DCP writes (the unpickler allows DCP's classes, not their contents)."""
    if not isinstance(metadata, Metadata):
        return f"damaged (holds {type(metadata).__name__}, not DCP's Metadata)"
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "damaged (no table of tensors, or no table of where their pieces are)"
    for key, entry in entries.items():
        if isinstance(key, str) and isinstance(entry, BytesStorageMetadata):  # (only through `bytes_entries`)
            continue
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata):
            return f"damaged (entry {_quoted(key)} is {type(entry).__name__}, not a tensor's record)"
        name = _quoted(key)
        size, properties, chunks = (getattr(entry, field, None) for field in ("size", "properties", "chunks"))
        if not _naturals(size):
            return f"tensor {name}: damaged (its size {printable(size, _SHOWN)} is not a list of sizes)"
        if not isinstance(properties, TensorProperties) or not isinstance(
            getattr(properties, "dtype", None), torch.dtype
        ):
            return f"tensor {name}: damaged (no dtype)"
        if not isinstance(chunks, list) or not all(
            isinstance(chunk, ChunkStorageMetadata)
            and _naturals(getattr(chunk, "offsets", None))
            and _naturals(getattr(chunk, "sizes", None))
            for chunk in chunks
        ):
            return f"tensor {name}: damaged (its pieces are not offsets and sizes)"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"damaged (a storage entry's key is {type(index).__name__}, not DCP's MetadataIndex)"
        relative, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if not isinstance(relative, str) or not _natural(offset) or not _natural(length):
            return f"the storage entry of {_quoted(index.fqn)} is not a file name, an offset and a length"
        if getattr(info, "transform_descriptors", None):  # compressed or otherwise transformed pieces
            return f"the storage entry of {_quoted(index.fqn)} is transformed ({_quoted(info.transform_descriptors)})"
        if problem := _path_problem(relative):
            return f"the storage entry of {_quoted(index.fqn)} names {_quoted(relative)}, {problem}"
    return None


def _path_problem(relative: str) -> str | None:
    """Why `relative` is not a path DCP may read a piece from: absolute, leaving the folder (`..`), empty."""
    parts = PurePosixPath(relative).parts
    if not relative or "\x00" in relative or not parts:
        return "not a file name"
    if relative.startswith(("/", "\\")) or PurePosixPath(relative).is_absolute():
        return "an absolute path (a checkpoint names only its own files)"
    if ".." in parts or ".." in relative.split("\\"):
        return "a path out of the checkpoint's folder (a checkpoint names only its own files)"
    return None


def _check_files(folder: Path, metadata: Metadata) -> None:
    """Each file the storage entries name: a regular file within `folder`, as long as the pieces it holds there."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        path = folder / relative
        if not os.path.lexists(path):
            raise InputError(f"{_shown(path)}: missing (a shard of this DCP checkpoint; {METADATA} names it)")
        if file_within(folder, path) is None:
            raise InputError(f"{_shown(path)}: refused: {why_skipped(folder, path)} ({METADATA} names it)")
        if (found := path.stat().st_size) < size:
            raise InputError(f"{_shown(path)}: truncated ({found} bytes, {METADATA} places pieces up to byte {size})")


def _tensors_problem(metadata: Metadata) -> str | None:
    """Each tensor tiled by its pieces, each piece with its storage entry."""
    storage = metadata.storage_data
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                return f"entry {_quoted(key)} has no storage entry (no file holds it)"
            continue
        pieces = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks]
        if problem := tiling_problem(entry.size, pieces):
            return f"tensor {_quoted(key)} of shape {list(entry.size)}: {problem}"
        for offsets, sizes in pieces:
            if math.prod(sizes) and MetadataIndex(key, offsets) not in storage:
                return f"tensor {_quoted(key)}: its piece at {list(offsets)} has no storage entry (no file holds it)"
    return None


_MAX_BYTES_ENTRY = 256 << 20  # a pickled value of an optimizer's parameter groups is a few KB


def _check_bytes(folder: Path, metadata: Metadata) -> None:
    """Each pickled value (`BytesStorageMetadata`) loads with `torch.load(weights_only=True)`, read from its file."""
    for key, entry in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(entry, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(key)]
        path = folder / info.relative_path
        if info.length > _MAX_BYTES_ENTRY:
            raise InputError(f"{_shown(path)}: entry {_quoted(key)} is {info.length} bytes of pickle, too large")
        with open(path, "rb") as file:
            file.seek(info.offset)
            data = file.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # noqa: BLE001 - UnpicklingError for a foreign object; others for damage
            raise InputError(
                f"{_shown(path)}: entry {_quoted(key)} holds objects other than tensors and plain containers, or is "
                f"damaged (refused: checkpoints load with weights_only=True; {type(error).__name__})"
            ) from None


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _naturals(value) -> bool:
    return isinstance(value, tuple | list) and all(_natural(n) for n in value)


def _shown(path: Path) -> str:
    return printable(path, 400)


def _quoted(value) -> str:
    return f"'{printable(value, _SHOWN)}'"


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
