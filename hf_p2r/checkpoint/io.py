"""Filesystem side of checkpoints: outputs are built in a temporary folder beside the destination and renamed into
place at the end, so a destination is either absent, the old one, or complete."""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `destination`; on success it replaces `destination`.

    A non-empty `destination` is refused unless `overwrite`. On any exception (KeyboardInterrupt included) the temporary
    folder is removed and `destination` is left untouched.
    """
    destination = Path(destination)
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"{destination}: exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise FileExistsError(f"{destination}: folder is not empty (pass overwrite=True to replace it)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        yield tmp
        if destination.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
            os.replace(destination, old / destination.name)
            os.replace(tmp, destination)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
