"""Filesystem side of checkpoints: outputs are built in a temporary folder beside the destination and renamed into
place at the end, so a destination is either absent, the old one, or complete (and a folder another process filled
meanwhile is never replaced without `overwrite`); config.json is read with errors that name the file; and what a folder
holds is listed without following a link out of it (`files_within`), with the reason for what is skipped
(`why_skipped`)."""

import contextlib
import ctypes
import errno
import functools
import glob
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError, printable, read_json

CONFIG_NAME = "config.json"
# How deeply a config.json may nest (transformers' configs nest 2 or 3 levels: rope_parameters, quantization_config).
MAX_CONFIG_DEPTH = 32
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>: swap the two paths atomically


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `destination`; on success it replaces `destination`.

    A non-empty `destination` is refused unless `overwrite`, when the call starts and again at the rename: the new
    folder is renamed onto `destination` by one `rename(2)`, which the kernel refuses when `destination` is a folder
    that is not empty, so an output another process finished meanwhile (two conversions to one folder) is never
    replaced without `overwrite` (`FileExistsError`, and this call's folder is removed). An empty `destination` folder
    is replaced. With `overwrite`, an existing `destination` is swapped with the new folder in one
    `renameat2(RENAME_EXCHANGE)` where the kernel and filesystem support it, so it is never absent, even if the process
    dies at that moment; elsewhere it is moved aside, then replaced (two renames).

    A `destination` that is a link is written through: the output replaces the link's target (the link is kept), and
    the temporary folder is made beside the target. A link that loops is refused.

    On any exception (KeyboardInterrupt included) the temporary folder, and any parent folder this call created, are
    removed and `destination` is left untouched. The folder is named `.{name}.tmp-{pid}-{host}-{random}`, so that
    temporary folders a killed process (kill -9, out of memory) left behind are recognised and removed by the next
    `atomic_directory` for the same destination: only those of this host whose process is gone. It is created like
    `mkdir` creates folders (mode 0777 less the umask).
    """
    destination = resolve_destination(destination)
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"{destination}: exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise FileExistsError(f"{destination}: folder is not empty (overwrite=True, or --overwrite, replaces it)")
    created = _make_parents(destination.parent)
    try:
        remove_stale_temporaries(destination)
        tmp = _make_folder(destination, "tmp")
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield tmp
        try:
            os.rename(tmp, destination)  # absent, or an empty folder: replaced; a non-empty folder: refused
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not overwrite:
                raise FileExistsError(
                    f"{destination}: another process wrote this folder while this one ran; it was left as it is and "
                    "this output was discarded (overwrite=True, or --overwrite, replaces it)"
                ) from None
            if _exchange(tmp, destination):
                shutil.rmtree(tmp, ignore_errors=True)  # `tmp` now holds the old destination
            else:
                old = _make_folder(destination, "old")
                os.replace(destination, old / destination.name)
                os.replace(tmp, destination)
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def resolve_destination(destination: str | os.PathLike) -> Path:
    """Where an output named `destination` is written: `destination` itself, or, when it is a link (to a folder, or
    dangling), the link's final target. A link loop raises `InputError`."""
    destination = Path(destination)
    if not destination.is_symlink():
        return destination
    target = Path(os.path.realpath(destination))
    if target.is_symlink():  # realpath stops where the links loop
        raise InputError(f"{destination}: a link that loops ({destination} -> {os.readlink(destination)})")
    return target


def _make_parents(folder: Path) -> list[Path]:
    """`mkdir -p folder`; returns the folders it created, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


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
    """The parsed config.json of a checkpoint folder; `FileNotFoundError` / `InputError` name the file and problem.

    The file must lie within `folder` (`file_within`: a link into a Hub cache's blobs is fine, a link out of the
    folder or a FIFO is refused) and is read by `hf_p2r.errors.read_json` (malformed, too large or nested too deeply:
    one line). Nesting is bounded further (`MAX_CONFIG_DEPTH`), so that writing the config again cannot recurse too
    deeply either."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{folder}: no {CONFIG_NAME} (not a checkpoint folder)")
    if file_within(folder, path) is None:
        raise InputError(f"{path}: {why_skipped(folder, path)}: not read")
    config = read_json(path)
    if _depth(config) > MAX_CONFIG_DEPTH:
        raise InputError(f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep (more than any model config)")
    return config


def _depth(value) -> int:
    """How deeply a JSON value nests (a scalar: 0; counted up to `MAX_CONFIG_DEPTH` + 1), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list) and depth < MAX_CONFIG_DEPTH + 1:
            deepest = max(deepest, depth + 1)
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def why_skipped(folder: str | os.PathLike, path: str | os.PathLike) -> str:
    """Why `file_within(folder, path)` refuses `path`, in a few words: "a link out of FOLDER (to TARGET)", "a FIFO",
    "a dangling link"..."""
    path = Path(path)
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):
            return "a dangling link or a link loop"
        if target.is_dir():
            return f"a link to a folder ({printable(target)})"
        if not target.is_file():
            return f"a link to {_kind(target)} ({printable(target)})"
        return f"a link out of {printable(folder)} (to {printable(target)})"
    return _kind(path)


def _kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as error:
        return f"unreadable ({error.strerror})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


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


def check_only_files_within(folder: str | os.PathLike) -> None:
    """`InputError` naming the first entry of `folder` (its subfolders and hidden entries included) that is not a
    regular file or a folder within it (`file_within`): a link out of it, a link to a folder, a dangling link, a FIFO,
    a device, a socket. For a folder whose every file something loads (a resume checkpoint): what it names must be its
    own files."""
    folder = Path(folder)
    for parent, dirnames, filenames in os.walk(folder):  # does not walk into links to folders
        base = Path(parent)
        dirnames.sort()
        for name in [*(d for d in dirnames if (base / d).is_symlink()), *sorted(filenames)]:
            if file_within(folder, base / name) is None:
                raise InputError(
                    f"{printable(base / name)}: refused: {why_skipped(folder, base / name)} (a checkpoint holds only "
                    "its own files)"
                )


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
