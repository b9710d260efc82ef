"""Filesystem side of checkpoints: outputs are built in a temporary folder beside the destination and renamed into
place at the end, so a destination is either absent, the old one, or complete; config.json is read with errors that
name the file."""

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from transformers.utils import CONFIG_NAME


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
        raise FileExistsError(f"{destination}: folder is not empty (overwrite=True, or --overwrite, replaces it)")
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
