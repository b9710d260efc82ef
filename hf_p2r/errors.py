"""What hf-p2r says when its input is wrong: one error type for bad input, one exit-code rule, one JSON reader; and
how everything it says is shown: names from disk with their control characters escaped (`printable`), and never the
Hub token (`redact`, `redacted_output`).

Every tool of hf-p2r (`hf-p2r convert / push / plan`, the trainer) reads files it did not write: config.json, shard
indexes, safetensors headers, trainer_state.json, YAML. Whatever those hold (malformed, truncated, nested a million
deep, gigabytes long, a FIFO instead of a file), the tool ends with one line naming the file or field and the problem.
This module is torch-free and imports nothing of hf_p2r: every layer may use it.

```python
>>> from hf_p2r.errors import read_json
>>> config = read_json("pseudo/config.json")  # InputError("pseudo/config.json: not valid JSON (...)") if damaged
```

The Hub token is redacted on the way out, once, whatever printed it: `redacted_output` wraps the process's stdout and
stderr (and the logging handlers writing to them) while a command runs, so a library's message, a log line, a
warning or a traceback that quotes the token (a server echoing a request's headers in its error) shows `***`.
"""

import contextlib
import io
import json
import logging
import os
import re
import stat
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "MAX_JSON_BYTES",
    "InputError",
    "exit_code",
    "parse_json",
    "one_line",
    "printable",
    "read_json",
    "redact",
    "redacted_output",
    "run_redacted",
]

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


def printable(text, limit: int | None = None) -> str:
    """`text` (a name from disk, a key, a field's value; any object, as `str` shows it) as a message quotes it: as it is
    when every character is printable, else with the others escaped as Python escapes them (a newline as ``\\n``, an
    escape sequence as ``\\x1b``), so that a file named with a newline cannot forge a line of output, nor a name move
    the terminal's cursor. Cut to `limit` characters (ending in "...") when given.

    ```python
    >>> printable("model\\n.safetensors")
    'model\\\\n.safetensors'
    ```
    """
    text = str(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if limit is None or len(text) <= limit else f"{text[: limit - 3]}..."


def one_line(message: str, limit: int | None = None) -> str:
    """`message` on one line (some libraries' messages span several), its other control characters escaped
    (`printable`), cut to `limit` characters when given: how every expected error is printed."""
    return printable(" ".join(line.strip() for line in str(message).splitlines() if line.strip()), limit)


# What a Hugging Face access token looks like ("hf_" and 34 letters or digits; 20 or more, to be safe).
_TOKEN_SHAPE = re.compile(r"hf_[A-Za-z0-9]{20,}")
# The environment variables huggingface_hub reads a token from.
_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_SHORTEST_TOKEN = 8  # a shorter "token" is not one: replacing it everywhere would garble the output


def redact(text: str) -> str:
    """`text` without the Hub token: the token of this process (HF_TOKEN, or huggingface_hub's own, `get_token`, once
    huggingface_hub is loaded: only then can anything have sent it) and anything shaped like a Hugging Face token
    become `***`."""
    for token in _tokens():
        if token in text:
            text = text.replace(token, "***")
    return _TOKEN_SHAPE.sub("***", text) if "hf_" in text else text


def _tokens() -> list[str]:
    found = [os.environ.get(name, "").strip() for name in _TOKEN_VARIABLES]
    if "huggingface_hub" in sys.modules:
        try:
            from huggingface_hub import get_token

            found.append(get_token() or "")
        except Exception:  # noqa: BLE001, S110 - no token then; redaction must never fail a command
            pass
    return sorted({token for token in found if len(token) >= _SHORTEST_TOKEN}, key=len, reverse=True)


class _Redacting(io.TextIOBase):
    """A text stream that writes to `stream` what it is given, `redact`ed; anything else is `stream`'s."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._stream, "errors", "strict")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """Within it, everything written to `sys.stdout` and `sys.stderr` is `redact`ed on its way out: prints, warnings,
    progress bars, tracebacks, and the logging handlers that write to either stream (those made before it too)."""
    if isinstance(sys.stdout, _Redacting) or isinstance(sys.stderr, _Redacting):  # already (a command in a command)
        yield
        return
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    wrapped = {name: _Redacting(stream) if stream is not None else None for name, stream in streams.items()}
    handlers = [
        handler
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in getattr(logger, "handlers", ())
        if isinstance(handler, logging.StreamHandler)
        and any(handler.stream is s for s in streams.values() if s is not None)
    ]
    sys.stdout, sys.stderr = wrapped["stdout"], wrapped["stderr"]
    previous = []
    for handler in handlers:
        stream = handler.stream
        try:
            handler.setStream(wrapped["stdout" if stream is streams["stdout"] else "stderr"])
        except AttributeError:  # a handler that looks sys.stderr up when it writes (logging's last resort)
            continue
        previous.append((handler, stream))
    try:
        yield
    finally:
        for handler, stream in previous:
            handler.setStream(stream)
        if sys.stdout is wrapped["stdout"] is not None:
            sys.stdout = streams["stdout"]
        if sys.stderr is wrapped["stderr"] is not None:
            sys.stderr = streams["stderr"]


def run_redacted(main: Callable[[], int | None]) -> int:
    """`main()`'s exit status, with everything it prints `redact`ed (`redacted_output`); an exception it lets through
    (a bug, not an expected error: those are one line) is printed as Python prints it, redacted, and is exit status
    1. For a command's entry point: `sys.exit(run_redacted(lambda: main(argv)))`."""
    with redacted_output():
        try:
            return main() or 0
        except Exception:  # noqa: BLE001 - the traceback, through the redacting stream
            traceback.print_exc()
            sys.stderr.flush()
            return 1
