"""Filesystem side of checkpoints: outputs are built in a temporary folder beside the destination and renamed into
place at the end, so a destination is either absent, the old one, or complete; config.json is read with errors that
name the file; and what a folder holds is listed without following a link out of it (`files_within`)."""

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

CONFIG_NAME = "config.json"
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>: swap the two paths atomically


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `destination`; on success it replaces `destination`.

    A non-empty `destination` is refused unless `overwrite`. On any exception (KeyboardInterrupt included) the temporary
    folder is removed and `destination` is left untouched. The folder is named `.{name}.tmp-{pid}-{host}-{random}`, so
    that temporary folders a killed process (kill -9, out of memory) left behind are recognised and removed by the next
    `atomic_directory` for the same destination: only those of this host whose process is gone. It is created like
    `mkdir` creates folders (mode 0777 less the umask). An existing `destination` is swapped with the new folder in one
    `renameat2(RENAME_EXCHANGE)` where the kernel and filesystem support it, so it is never absent, even if the process
    dies at that moment; elsewhere it is moved aside, then replaced (two renames).
    """
    destination = Path(destination)
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"{destination}: exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise FileExistsError(f"{destination}: folder is not empty (overwrite=True, or --overwrite, replaces it)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(destination)
    tmp = _make_folder(destination, "tmp")
    try:
        yield tmp
        if not destination.exists():
            os.replace(tmp, destination)
        elif _exchange(tmp, destination):
            shutil.rmtree(tmp, ignore_errors=True)  # `tmp` now holds the old destination
        else:
            old = _make_folder(destination, "old")
            os.replace(destination, old / destination.name)
            os.replace(tmp, destination)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(destination: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders that `atomic_directory(destination)` calls of dead processes left beside it;
    returns them.

    Only folders named for this destination and this host whose process no longer exists are touched: another
    host's (a shared filesystem) or a live process's (a concurrent write) are left alone. A moved-aside old copy
    (`.old-`) is removed only once the destination exists again.
    """
    destination = Path(destination)
    pattern = re.compile(rf"\.{re.escape(destination.name)}\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<host>.+)-[0-9a-f]+")
    removed = []
    for path in destination.parent.glob(f".{glob.escape(destination.name)}.*-*"):
        match = pattern.fullmatch(path.name)
        if match is None or match["host"] != _host() or _alive(int(match["pid"])) or not path.is_dir():
            continue
        if match["kind"] == "old" and not destination.exists():
            continue  # the only copy left of the old destination
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def read_config_dict(folder: str | os.PathLike) -> dict:
    """The parsed config.json of a checkpoint folder; `FileNotFoundError` / `ValueError` name the file and problem."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_NAME} (not a checkpoint folder)")
    try:
        config = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def file_within(folder: str | os.PathLike, path: str | os.PathLike) -> Path | None:
    """Where `path` (a file in `folder`) really lies, if it is a regular file within `folder`; None otherwise.

    `folder` itself may be a link (the user named it). A link inside it is followed only as far as `folder`: its
    target must lie within `folder`, or, when `folder` is a snapshot of the Hugging Face cache
    (`.../models--org--name/snapshots/<revision>`), within that repository's `blobs/`, which is where the cache keeps
    every file of a snapshot. Anything else (a link out of the folder, e.g. to /etc/passwd or /proc/self; a dangling
    link or a link loop; a FIFO, a device, a folder) is None: hf-p2r's tools do not read, copy or upload it.
    """
    root = Path(folder).resolve()
    try:
        target = Path(path).resolve(strict=True)
        mode = target.stat().st_mode
    except (OSError, RuntimeError):  # dangling, a loop, unreadable
        return None
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        roots.append(root.parent.parent / "blobs")
    if not any(target.is_relative_to(allowed) for allowed in roots) or not stat.S_ISREG(mode):
        return None
    return target


def files_within(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(kept, skipped): the files of `folder` and its subfolders as relative POSIX paths, sorted; `kept` are regular
    files within it (`file_within`), `skipped` what is not (links that leave the folder, FIFOs, devices, links to
    folders, which are not walked into). Hidden entries (`.name`) and `__pycache__` are left out of both."""
    folder = Path(folder)
    kept, skipped = [], []
    for parent, dirnames, filenames in os.walk(folder):  # does not walk into links to folders
        base = Path(parent)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in [d for d in dirnames if (base / d).is_symlink()]:
            dirnames.remove(name)
            skipped.append((base / name).relative_to(folder).as_posix())
        for name in sorted(n for n in filenames if not n.startswith(".")):
            relative = (base / name).relative_to(folder).as_posix()
            (kept if file_within(folder, base / name) is not None else skipped).append(relative)
    return sorted(kept), sorted(skipped)


def file_mode() -> int:
    """The mode `open()` gives a new file (0666 less the umask): for files written by tools that make them 0600."""
    return 0o666 & ~_umask()


def _umask() -> int:
    # /proc reads it without changing it (os.umask can only set it, which would race with other threads).
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_folder(destination: Path, kind: str) -> Path:
    """A new empty folder `.{name}.{kind}-{pid}-{host}-{random}` beside `destination`, mode 0777 less the umask."""
    while True:
        path = destination.parent / f".{destination.name}.{kind}-{os.getpid()}-{_host()}-{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue


@functools.cache
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@functools.cache
def _renameat2():
    """glibc's renameat2 (2.28+), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one step; False where the C library, kernel or filesystem cannot (nothing was changed)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
