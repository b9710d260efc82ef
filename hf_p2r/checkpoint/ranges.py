"""Writing a checkpoint whose tensors are byte-for-byte copies of tensors in other files, at the speed of the disk.

Each output shard is the header safetensors would write (`headers.build_header`) followed by byte ranges of the
source files, copied by the kernel: `os.copy_file_range` (what `cp` uses; no byte passes through this process), and
on filesystems with reflinks (XFS, btrfs) `FICLONERANGE` for the block-aligned part of a range, which shares blocks
instead of copying them: a block's later copies are cloned from its first copy in the same shard when their offsets
line up (the layers of a block whose size is a multiple of the filesystem block: all but the first are not written).
Where the kernel or filesystem refuses both, ranges are copied with pread/pwrite. Where ranges are copied, not cloned,
a shard's blocks are first allocated in one call (`fallocate`): a full disk fails before anything is copied, and the
filesystem lays the shard out in long extents instead of allocating block by block as the pages are written back
(`cp` does not preallocate; benchmarks/convert.md compares the two). No torch:
a delinked checkpoint is mostly copies of its pseudo blocks, so converting one needs no tensor.
"""

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from .headers import TensorInfo, build_header, plan_shards, write_index

_FICLONERANGE = 0x4020940D  # <linux/fs.h>: _IOW(0x94, 13, struct file_clone_range)
# errnos meaning "this kernel/filesystem cannot do that here", not "the copy failed": the next method is tried.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY, errno.EBADF, errno.EPERM}
# Bytes per copy_file_range call: small enough that a stop (another shard failed, Ctrl-C) is seen within ~0.1 s of disk
# time, large enough that the calls cost nothing (16 per GB).
_CHUNK = 64 << 20


def copy_checkpoint(folder: str | os.PathLike, tensors: Mapping[str, TensorInfo], **options) -> list[Path]:
    """Write the checkpoint {output name: where its bytes are} into `folder`: the same files, byte for byte, as
    `write_checkpoint` writes from the same tensors (shards of at most `max_shard_size` planned in the order of
    `tensors`, `model.safetensors.index.json` when sharded); returns the files written. `options` are `copying`'s.

    The bytes are copied by the kernel (see the module's docstring) by up to `workers` threads (default: the CPU
    count, at most 4), range by range; anonymous memory does not grow with the model. `folder` must exist (make it
    with `atomic_directory`). A progress bar over bytes is shown on a terminal when `progress`.
    """
    with copying(folder, tensors, **options) as files:
        pass
    return files


@contextlib.contextmanager
def copying(
    folder: str | os.PathLike,
    tensors: Mapping[str, TensorInfo],
    *,
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
    progress: bool = True,
    workers: int | None = None,
) -> Iterator[list[Path]]:
    """`copy_checkpoint` in the background of a `with` block, which gets the files' paths: the files (headers written,
    at their final sizes) exist when the block starts and the kernel fills them while it runs, so that writing the rest
    of a checkpoint (config, model card) costs no extra time; on leaving, the copies are waited for. If the block or
    a copy fails (or Ctrl-C), copies not yet started are cancelled and the running ones waited for before the error
    goes on."""
    folder = Path(folder)
    shards = plan_shards({name: (info.dtype, info.shape) for name, info in tensors.items()}, max_shard_size)
    header = {"format": "pt", **(metadata or {})}
    total = sum(t.nbytes for t in tensors.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=None if progress else True)
    with bar, _Copier(folder) as copier:
        for filename, names in shards.files.items():
            copier.shard(folder / filename, {name: tensors[name] for name in names}, header)
        files = [folder / filename for filename in shards.files] + write_index(folder, shards)
        with ThreadPoolExecutor(max(1, min(workers or min(os.cpu_count() or 1, 4), len(copier.shards)))) as pool:
            futures = [pool.submit(copier.copy_shard, *shard, bar) for shard in copier.shards]
            try:
                yield files
                results(futures)
            except BaseException:  # the block or a copy failed, or Ctrl-C: stop after the ranges being copied
                copier.stop.set()
                for future in futures:
                    future.cancel()
                raise


def results(futures: list[Future]) -> list:
    """What each of `futures` returned, in order; a worker's failure raised as soon as it happens. The main thread waits
    in slices of 0.1 s: Python runs a signal's handler in the main thread once that thread runs, and the kernel may hand
    the signal (Ctrl-C, SIGTERM) to a worker thread, which does not wake a main thread blocked on a lock, so a stop
    would wait for the whole copy instead of the next piece."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()
    return [future.result() for future in futures]


class _Copier:
    """The copies of a checkpoint, shard by shard; files stay open until the end."""

    def __init__(self, folder: Path):
        self.shards: list[tuple] = []  # arguments of `copy_shard`: path, fd, [(output offset, source)], bytes
        self.fds: dict[Path, int] = {}
        self.reflinks = can_clone(folder)  # and until the filesystem says otherwise
        self.stop = threading.Event()

    def shard(self, path: Path, tensors: dict[str, TensorInfo], header: dict) -> None:
        raw, offsets = build_header({name: (t.dtype, t.shape) for name, t in tensors.items()}, header)
        # Readable too: a later copy of a tensor may be cloned from an earlier one in this file.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)  # mode 0666 less the umask, like open()
        self.fds[path] = fd
        write_all(fd, raw, 0, path)
        size = sum(t.nbytes for t in tensors.values())
        try:
            os.ftruncate(fd, len(raw) + size)  # its final size now: the header describes the file
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(path)) from None
        ranges = sorted(((offsets[name], info) for name, info in tensors.items()), key=lambda r: r[0])  # in order
        self.shards.append((path, fd, ranges, size))

    def _open(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def copy_shard(self, path: Path, out: int, ranges: list[tuple[int, TensorInfo]], size: int, bar) -> None:
        """Copy the ranges of one shard, front to back. Where the filesystem has reflinks, a tensor this shard already
        holds at an offset that lines up with the new one (the L copies of a block whose size is a multiple of the
        filesystem block) is cloned from that earlier copy: only the first copy's blocks are written."""
        stat = os.fstat(out)
        block, end = stat.st_blksize or 4096, stat.st_size
        earlier: dict[tuple, list[int]] = {}  # (source file, offset, bytes) -> where this shard already holds them
        allocated = False  # the blocks from here to the end, once we know they will be copied, not cloned
        if ranges and not self.reflinks and not self.stop.is_set():
            allocated = self._allocate(path, out, ranges[0][0], end)
        for out_offset, info in ranges:
            if self.stop.is_set():
                return
            key = (info.file, info.offset, info.nbytes)
            source, offset = self._open(info.file), info.offset
            if self.reflinks:
                done = next((done for done in earlier.get(key, ()) if (out_offset - done) % block == 0), None)
                if done is not None:
                    source, offset = out, done
            try:
                try:
                    copy_range(source, offset, out, out_offset, info.nbytes, reflink=self.reflinks, stop=self.stop)
                except _NoReflinks:
                    self.reflinks = False
                    allocated = allocated or self._allocate(path, out, out_offset, end)
                    copy_range(
                        self._open(info.file), info.offset, out, out_offset, info.nbytes, reflink=False, stop=self.stop
                    )
            except Stopped:
                return
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
            earlier.setdefault(key, []).append(out_offset)
        bar.update(size)  # once per shard, as `write_checkpoint`'s bar

    @staticmethod
    def _allocate(path: Path, out: int, start: int, end: int) -> bool:
        try:
            return allocate(out, start, end - start)
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(path)) from None

    def __enter__(self) -> "_Copier":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)


def allocate(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate the blocks of `nbytes` from `offset` of the open file `fd` (`fallocate(2)`, mode 0: the size does not
    change inside the file); raises OSError (ENOSPC: the disk is full). Where the filesystem cannot, nothing is done
    (glibc's `posix_fallocate` would instead write a byte into every block). Returns True."""
    if nbytes <= 0:
        return True
    if _fallocate(fd, 0, offset, nbytes) != 0:
        code = ctypes.get_errno()
        if code not in _UNSUPPORTED:
            raise OSError(code, os.strerror(code))
    return True


def can_clone(folder: Path) -> bool:
    """Whether the filesystem of `folder` clones blocks between files (FICLONERANGE of one block between two scratch
    files, removed again)."""
    block = os.statvfs(folder).f_bsize or 4096
    first, second = folder / ".clone-probe-source", folder / ".clone-probe"
    fds = []
    try:
        fds.append(os.open(first, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        fds.append(os.open(second, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        write_all(fds[0], bytes(block), 0)
        fcntl.ioctl(fds[1], _FICLONERANGE, struct.pack("qQQQ", fds[0], 0, block, 0))
        return True
    except OSError as error:
        if error.errno in _UNSUPPORTED:
            return False
        raise
    finally:
        for fd in fds:
            os.close(fd)
        for path in (first, second):
            path.unlink(missing_ok=True)


def _libc_fallocate():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):  # not Linux: nothing to allocate with
        return lambda *args: 0
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int
    return function


_fallocate = _libc_fallocate()


class _NoReflinks(Exception):
    """The filesystem cannot clone: copy instead, and do not try again."""


class Stopped(Exception):
    """A copy or write gave up part-way because its `stop` event was set (another shard failed, or Ctrl-C): what it
    wrote is incomplete, and the caller removes it."""


def copy_range(
    source: int,
    offset: int,
    out: int,
    out_offset: int,
    nbytes: int,
    *,
    reflink: bool = True,
    stop: threading.Event | None = None,
) -> None:
    """Copy `nbytes` from file descriptor `source` at `offset` to `out` at `out_offset`.

    Where both offsets fall at the same place in a filesystem block, the whole blocks in between are cloned
    (FICLONERANGE: they share the source's blocks, no data is copied) when `reflink`; the rest is copied by
    `copy_file_range`, or by pread/pwrite where the kernel or filesystem refuses it, at most 64 MB per call: `stop`,
    when set, is seen between two calls (`Stopped`). Raises `_NoReflinks` (before writing anything) when the
    filesystem cannot clone."""
    block = os.fstat(out).st_blksize or 4096
    head = -out_offset % block
    middle = (nbytes - head) // block * block if nbytes > head else 0
    if reflink and middle and (offset - out_offset) % block == 0:
        try:
            fcntl.ioctl(out, _FICLONERANGE, struct.pack("qQQQ", source, offset + head, middle, out_offset + head))
        except OSError as error:
            if error.errno in _UNSUPPORTED:
                raise _NoReflinks from None
            raise
        _copy_bytes(source, offset, out, out_offset, head, stop)
        tail = head + middle
        _copy_bytes(source, offset + tail, out, out_offset + tail, nbytes - tail, stop)
        return
    _copy_bytes(source, offset, out, out_offset, nbytes, stop)


def _copy_bytes(source: int, offset: int, out: int, out_offset: int, nbytes: int, stop) -> None:
    while nbytes > 0:
        if stop is not None and stop.is_set():
            raise Stopped
        try:
            done = os.copy_file_range(source, out, min(nbytes, _CHUNK), offset, out_offset)
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                raise
            return _pread_pwrite(source, offset, out, out_offset, nbytes, stop)
        if done == 0:
            raise OSError(errno.EIO, "the source file ended before the tensor's last byte (truncated while copying?)")
        offset, out_offset, nbytes = offset + done, out_offset + done, nbytes - done


def _pread_pwrite(source: int, offset: int, out: int, out_offset: int, nbytes: int, stop) -> None:
    while nbytes > 0:
        if stop is not None and stop.is_set():
            raise Stopped
        data = os.pread(source, min(nbytes, 1 << 24), offset)
        if not data:
            raise OSError(errno.EIO, "the source file ended before the tensor's last byte (truncated while copying?)")
        write_all(out, data, out_offset)
        offset, out_offset, nbytes = offset + len(data), out_offset + len(data), nbytes - len(data)


def write_all(fd: int, data, offset: int, path: Path | None = None) -> None:
    """Write all of `data` (any bytes-like object) into `fd` from `offset` (pwrite until done); an OSError names
    `path`."""
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path) if path else None) from None
