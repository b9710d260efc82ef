"""Writing sharded safetensors checkpoints with constant anonymous memory.

Each shard is written by this module as safetensors' `serialize_file` writes it (the header of `headers.build_header`,
then the tensors' bytes back to back: the same file, byte for byte; a test checks it), in pieces of at most 16 MB:

- a tensor that is already CPU, contiguous and of the output dtype is written straight from where it lives (e.g. a
  memory-mapped source file), without a copy in this process;
- a tensor that needs work first (a dtype cast, a GPU tensor, a non-contiguous view) is converted piece by piece into
  one 16 MB buffer per writing thread, and written from there;
- a tensor written under several names in one shard (one pseudo block becoming L real layers) is converted once: its
  later copies are copied from its first one in the same file by the kernel (`ranges.copy_range`).

The shard's blocks are allocated first (`fallocate`), so a full disk fails before anything is written, as one
`OSError` naming the file (no memory-mapped scratch file, whose writes a full disk would turn into SIGBUS). Between two
pieces each writer looks at a stop event, set when another shard failed or on Ctrl-C / SIGTERM: a stop takes effect
within a piece's time (well under a second), not at the end of the shard.
"""

import ctypes
import math
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .headers import DTYPE_CODE_OF, build_header, parse_size, plan_shards, write_index
from .ranges import Stopped, allocate, copy_range, results, write_all

_PIECE = 16 << 20  # bytes written (and converted) at a time: the most a stop waits for, and each thread's buffer


def write_checkpoint(
    folder: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
    progress: bool = True,
    workers: int | None = None,
) -> list[Path]:
    """Write `tensors` into `folder` as `model.safetensors`, or shards `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json` when they exceed `max_shard_size`; returns the files written.

    Every name is written, including several names for one tensor (drop tied aliases first if you do not want them).
    `dtype` casts floating-point tensors; other tensors keep theirs. `metadata` is added to each file's header (next
    to `"format": "pt"`, which transformers requires). Shards are planned as huggingface_hub plans them
    (`headers.plan_shards`), in the order of `tensors`. `folder` must exist; write into a temporary folder
    (see `atomic_directory`) to make the checkpoint atomic. Files get mode 0666 less the umask, as `open()` gives.
    A progress bar over bytes is shown on a terminal when `progress`.

    Shards are written concurrently by up to `workers` threads (default: the CPU count, at most 4): the writes and
    casts release the GIL, and on the 2-core machine of benchmarks/convert.md two writers wrote 7 GB 1.6 to 2.5 times
    faster than one. Anonymous memory does not grow with the checkpoint: each thread holds one 16 MB buffer. A failure
    (a full disk: `OSError` naming the file) or an interruption (KeyboardInterrupt, which SIGTERM also is under
    `hf-p2r`) stops every writer within a piece, then goes on; the caller removes the partial files.
    """
    folder = Path(folder)
    max_shard_size = parse_size(max_shard_size)
    out_dtypes = {name: output_dtype(tensor, dtype) for name, tensor in tensors.items()}
    shards = plan_shards(
        {name: (_code(out_dtypes[name]), tuple(t.shape)) for name, t in tensors.items()}, max_shard_size
    )
    header = {"format": "pt", **(metadata or {})}
    nbytes = {name: t.numel() * out_dtypes[name].itemsize for name, t in tensors.items()}
    stop = threading.Event()

    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, disable=None if progress else True)

    def write_shard(filename: str, names: list[str]) -> Path:
        write_file(folder / filename, {name: tensors[name] for name in names}, out_dtypes, header, stop=stop)
        bar.update(sum(nbytes[name] for name in names))
        return folder / filename

    workers = min(workers or min(os.cpu_count() or 1, 4), len(shards.files))
    with bar, ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(write_shard, *item) for item in shards.files.items()]
        try:
            written = results(futures)
        except BaseException:  # a failed shard or Ctrl-C: stop the running shards, start no further ones
            stop.set()
            for future in futures:
                future.cancel()
            raise

    return written + write_index(folder, shards)


def write_file(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    out_dtypes: Mapping[str, torch.dtype],
    header: Mapping[str, str],
    *,
    stop: threading.Event | None = None,
) -> None:
    """Write one safetensors file `path` (it must not exist) holding `tensors`, each in its `out_dtypes` entry, with
    `header` as its metadata: the module's docstring says how. Raises `Stopped` when `stop` is set part-way, and an
    `OSError` naming `path` when the disk is full."""
    fd, offsets = create_file(path, {name: (out_dtypes[name], tuple(t.shape)) for name, t in tensors.items()}, header)
    try:
        buffer: list[torch.Tensor] = []  # the conversion buffer, made on first need
        first: dict[tuple, int] = {}  # (source tensor, output dtype) -> where this file already holds its bytes
        for name in sorted(tensors, key=offsets.__getitem__):
            tensor, dtype, offset = tensors[name], out_dtypes[name], offsets[name]
            nbytes = tensor.numel() * dtype.itemsize
            key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), dtype)
            try:
                if key in first:  # an earlier name's bytes: copied by the kernel within the file
                    copy_range(fd, first[key], fd, offset, nbytes, reflink=False, stop=stop)
                else:
                    write_tensor(fd, offset, tensor, dtype, buffer, stop)
                    first[key] = offset
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
    finally:
        os.close(fd)


def create_file(
    path: Path, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], header: Mapping[str, str]
) -> tuple[int, dict[str, int]]:
    """Create the safetensors file `path` (it must not exist) for tensors of `specs` ({name: (dtype, shape)}): its
    header written and its data blocks allocated, so a full disk fails here, before any tensor is written (an `OSError`
    naming `path`). Returns the open descriptor (read-write: later copies are read from the file; the caller closes
    it) and {name: offset of its data in the file}."""
    raw, offsets = build_header({name: (_code(dtype), shape) for name, (dtype, shape) in specs.items()}, header)
    size = len(raw) + sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            os.ftruncate(fd, size)
            allocate(fd, len(raw), size - len(raw))
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(path)) from None
        write_all(fd, raw, 0, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, offsets


def write_tensor(fd: int, offset: int, tensor: torch.Tensor, dtype: torch.dtype, buffer: list, stop=None) -> None:
    """Write `tensor`'s bytes in `dtype` at `offset` of `fd`, piece by piece, looking at `stop` between pieces (a
    `threading.Event`, or None). `buffer`: an empty list the first call fills with the 16 MB conversion buffer, passed
    again to reuse it. Also what `sharded_write` writes a process's rows of a tensor with."""
    if _writable_as_is(tensor, dtype):  # from its own memory, in pieces
        nbytes = tensor.numel() * tensor.element_size()
        for start in range(0, nbytes, _PIECE):
            if stop is not None and stop.is_set():
                raise Stopped
            length = min(_PIECE, nbytes - start)
            write_all(fd, (ctypes.c_char * length).from_address(tensor.data_ptr() + start), offset + start)
        return
    if not buffer:
        buffer.append(torch.empty(_PIECE, dtype=torch.uint8))
    for piece in _pieces(tensor, _PIECE // dtype.itemsize):
        if stop is not None and stop.is_set():
            raise Stopped
        length = piece.numel() * dtype.itemsize
        buffer[0][:length].view(dtype).view(piece.shape).copy_(piece)  # casts element by element on the way
        write_all(fd, (ctypes.c_char * length).from_address(buffer[0].data_ptr()), offset)
        offset += length


def _pieces(tensor: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of `tensor` that together are all of it in row-major order, each of at most `limit` elements."""
    if tensor.numel() <= limit:
        yield tensor
    elif tensor.is_contiguous():
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
    elif (row := tensor[0].numel()) <= limit:
        step = limit // row
        for start in range(0, tensor.shape[0], step):
            yield tensor[start : start + step]
    else:
        for index in range(tensor.shape[0]):
            yield from _pieces(tensor[index], limit)


def output_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` is written in: `dtype` for floating-point tensors when given, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _code(dtype: torch.dtype) -> str:
    """safetensors' code of a torch dtype ("BF16")."""
    return DTYPE_CODE_OF[str(dtype).removeprefix("torch.")]


def _writable_as_is(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype == dtype
