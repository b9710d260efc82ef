"""Writing sharded safetensors checkpoints with constant anonymous memory.

Each shard is one `safetensors.serialize_file` call over raw pointers (`TensorSpec`), so a tensor that is already CPU,
contiguous and of the output dtype is written straight from where it lives (e.g. a memory-mapped source file), and the
same tensor can be written under many names without a copy: that is how one pseudo block becomes L real layers.
Tensors that need work first (a dtype cast, a GPU tensor, a non-contiguous view) are staged one by one into a
file-backed scratch mapping, so their pages are page cache (reclaimable), not anonymous memory, whatever the shard size.
"""

import itertools
import os
import re
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, TensorSpec, serialize_file
from tqdm.auto import tqdm

from .headers import DTYPE_CODE_OF, parse_size, plan_shards, write_index
from .io import file_mode

_ALIGN = 64  # byte alignment of staged tensors in the scratch mapping (any dtype can view it)


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
    (see `atomic_directory`) to make the checkpoint atomic. A progress bar over bytes is shown on a terminal when
    `progress`.

    Shards are written concurrently by up to `workers` threads (default: the CPU count, at most 4): safetensors
    releases the GIL while it writes, and on the 2-core machine of benchmarks/convert.md two writers wrote 7 GB 1.6 to
    2.5 times faster than one. Anonymous memory does not grow with them: each thread only holds pointers.
    """
    folder = Path(folder)
    max_shard_size = parse_size(max_shard_size)
    out_dtypes = {name: output_dtype(tensor, dtype) for name, tensor in tensors.items()}
    codes = {name: DTYPE_CODE_OF[str(out_dtypes[name]).removeprefix("torch.")] for name in tensors}
    shards = plan_shards({name: (codes[name], tuple(t.shape)) for name, t in tensors.items()}, max_shard_size)
    header = {"format": "pt", **(metadata or {})}
    nbytes = {name: t.numel() * out_dtypes[name].itemsize for name, t in tensors.items()}

    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, disable=None if progress else True)

    def write_shard(filename: str, names: list[str]) -> Path:
        with _Staging(folder, {name: tensors[name] for name in names}, out_dtypes) as staged:
            _serialize({name: _spec(staged[name]) for name in names}, folder / filename, header)
        os.chmod(folder / filename, file_mode())  # safetensors writes through a 0600 temporary file
        bar.update(sum(nbytes[name] for name in names))
        return folder / filename

    workers = min(workers or min(os.cpu_count() or 1, 4), len(shards.files))
    with bar, ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(write_shard, *item) for item in shards.files.items()]
        try:
            written = [future.result() for future in futures]
        except BaseException:  # a failed shard or Ctrl-C: start no further shards
            for future in futures:
                future.cancel()
            raise

    return written + write_index(folder, shards)


def _serialize(specs: dict[str, TensorSpec], path: Path, header: dict[str, str]) -> None:
    try:
        serialize_file(specs, path, metadata=header)
    except SafetensorError as error:
        # An I/O failure (disk full, file too large...) is an OSError with its errno, like any other write.
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise
        errno = int(code[1])
        raise OSError(errno, os.strerror(errno), str(path)) from None


def output_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` is written in: `dtype` for floating-point tensors when given, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=list(tensor.shape),
        data_ptr=tensor.data_ptr(),
        data_len=tensor.numel() * tensor.element_size(),
    )


def _writable_as_is(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype == dtype


class _Staging:
    """The tensors of one shard, ready for `serialize_file`: as they are when possible, else staged in a scratch
    mapping of an unlinked temporary file in `folder` (so nothing is left behind, even if the process is killed).

    Each distinct source tensor is staged once per shard, however many names it is written under. The mapping, and
    so every pointer handed to `serialize_file`, lives until the `with` block ends.
    """

    def __init__(self, folder: Path, shard: Mapping[str, torch.Tensor], out_dtypes: Mapping[str, torch.dtype]):
        self.tensors: dict[str, torch.Tensor] = {}
        self._scratch = None
        groups: dict[tuple, list[str]] = {}  # one entry per (source tensor, output dtype) that needs staging
        for name, tensor in shard.items():
            if _writable_as_is(tensor, out_dtypes[name]):
                self.tensors[name] = tensor
            else:
                key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
                groups.setdefault((*key, out_dtypes[name]), []).append(name)
        if not groups:
            return
        sizes = [shard[names[0]].numel() * key[-1].itemsize for key, names in groups.items()]
        offsets = [0, *itertools.accumulate(-(-size // _ALIGN) * _ALIGN for size in sizes)]
        fd, path = tempfile.mkstemp(prefix=".scratch-", suffix=".bin", dir=folder)
        os.close(fd)
        try:
            self._scratch = torch.from_file(path, shared=True, size=offsets[-1], dtype=torch.uint8)
        finally:
            os.unlink(path)  # the mapping keeps its pages; the name is gone at once
        for (key, names), offset, size in zip(groups.items(), offsets, sizes):
            source = shard[names[0]]
            staged = self._scratch[offset : offset + size].view(key[-1]).view(source.shape)
            staged.copy_(source)  # casts element by element on the way: no full-size temporary
            self.tensors.update(dict.fromkeys(names, staged))

    def __enter__(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def __exit__(self, *exc) -> None:
        self.tensors.clear()
        self._scratch = None
