"""What hf-p2r says when its input is wrong: one error type for bad input, one exit-code rule, one JSON reader.

Every tool of hf-p2r (`hf-p2r convert / push / plan`, the trainer) reads files it did not write: config.json, shard
indexes, safetensors headers, trainer_state.json, YAML. Whatever those hold (malformed, truncated, nested a million
deep, gigabytes long, a FIFO instead of a file), the tool ends with one line naming the file or field and the problem.
This module is torch-free and imports nothing of hf_p2r: every layer may use it.

```python
>>> from hf_p2r.errors import read_json
>>> config = read_json("pseudo/config.json")  # InputError("pseudo/config.json: not valid JSON (...)") if damaged
```
"""

import json
import os
import stat
from pathlib import Path

__all__ = ["MAX_JSON_BYTES", "InputError", "exit_code", "parse_json", "read_json"]

# The largest JSON document hf-p2r reads (an index of a model with millions of tensors is tens of MB).
MAX_JSON_BYTES = 256 << 20
# OSErrors that mean "the path you gave is wrong" (bad input), not "the machine failed" (a run-time failure).
_BAD_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


class InputError(ValueError):
    """Bad input or configuration (a file, a field, a flag), told in one line that names it and the problem.

    A `ValueError`, so code that catches those keeps working. The command lines print the line and exit 2
    (`exit_code`)."""


def exit_code(error: BaseException) -> int:
    """The exit status of a command that ends with `error`: 2 for bad input or configuration (a `ValueError`, or a
    path that does not exist / already exists / is of the wrong kind), 1 for a failure at run time (a full disk, an
    I/O error, a non-finite loss...). argparse's own usage errors exit 2 too."""
    return 2 if isinstance(error, (ValueError, KeyError, *_BAD_PATH_ERRORS)) else 1


def parse_json(text: str | bytes, what: str | os.PathLike):
    """`json.loads(text)`, with every way a document can be malformed (bad syntax, bad UTF-8, nesting deeper than
    Python's recursion limit) raised as `InputError` naming `what` (a file name, or "header of FILE")."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{what}: not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise InputError(f"{what}: not valid JSON ({_first_line(error)})") from None


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, expect: type | None = dict):
    """The parsed JSON document in file `path` (a JSON object unless `expect` says otherwise; `expect=None` takes any).

    Refused with `InputError` naming the file: a path that is not a regular file (a folder, a FIFO, a device: never
    opened, so never blocks), a file over `max_bytes`, a malformed document, a document of another type. A missing file
    is `FileNotFoundError`."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file ({_kind(mode)})")
    with open(path, "rb") as file:
        data = file.read(max_bytes + 1)  # a file that grows, or lies about its size (/proc), is bounded too
    if len(data) > max_bytes:
        raise InputError(f"{path}: over {max_bytes >> 20} MiB, too large for a JSON file hf-p2r reads")
    value = parse_json(data, path)
    if expect is not None and not isinstance(value, expect):
        raise InputError(f"{path}: expected a JSON {_json_name(expect)}, got {_json_name(type(value))}")
    return value


def _first_line(error: Exception) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def _json_name(kind: type) -> str:
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return names.get(kind, "null" if kind is type(None) else kind.__name__)
