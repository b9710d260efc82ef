"""Text -> documents: the built-in corpus, local files (JSON lines, Parquet, text split at blank lines or a separator)
or a Hub dataset, read through `datasets`; an unreadable file is one line naming it."""

import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from datasets import Dataset, Features, IterableDataset, Value, load_dataset
from datasets.fingerprint import Hasher
from datasets.utils import logging as datasets_logging

from ...config import DataArguments
from ...errors import InputError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
PROSE_SUFFIXES = {".txt", ".md", ".rst"}  # split at blank lines by default; a .py file is one document
JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}
DATA_SUFFIXES = TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES
BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line break, then one or more lines of whitespace only
READ_CHARS = 1 << 20  # a text file is read this many characters at a time
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}  # not in the built-in corpus


def stdlib_corpus(max_bytes: int, column: str = "text") -> Dataset:
    """Python standard-library sources, about `max_bytes` of them, as a dataset with one file per row: the
    `python_sources` of the standard library's folder (the same on every machine with the same Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = python_sources(root, max_bytes)
    if not texts:
        raise FileNotFoundError(
            f"corpus_max_bytes: no Python source under {root} fits in {max_bytes} bytes; set train_files"
        )
    return Dataset.from_dict({column: texts})


def python_sources(root: Path, max_bytes: int) -> list[str]:
    """The texts of `.py` files under `root`, at most `max_bytes` of UTF-8 in all.

    Files are taken in the order of a hash of their relative path (a fixed, well-mixed order; the same on every
    machine with the same files), skipping tests and third-party packages (any file under a folder named in
    `SKIPPED_FOLDERS`), unreadable files and any file that would take the total past `max_bytes` (smaller ones after
    it still fill the budget). A skipped folder is not entered, and a file is read only if it may fit: its text, read
    with universal newlines, has at least half the bytes of the file (a "\\r\\n" becomes "\\n", every other byte
    stays), so a file of more than twice the room left is passed over unread.
    """
    files = []
    for folder, subfolders, names in os.walk(root):  # (a link to a folder is not followed, as `Path.rglob` does not)
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_FOLDERS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    files.sort(key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())
    texts, total = [], 0
    for path in files:
        try:
            if (path.stat().st_size + 1) // 2 > max_bytes - total:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        size = len(text.encode())
        if total + size <= max_bytes:
            texts.append(text)
            total += size
    return texts


def load_documents(args: DataArguments, split: str = "train") -> Dataset | IterableDataset:
    """Raw documents: the Hub dataset, the local files, or the built-in corpus (in that order of precedence); an
    `IterableDataset` read lazily when `args.streaming`. `split="validation"` is a streaming run's held-out stream:
    `validation_files`, else the Hub dataset's validation split."""
    if split == "validation" and args.validation_files:
        return _load_files(args, "validation_files", args.validation_files)
    if args.dataset_name:
        source = args.dataset_name
        try:
            dataset = load_dataset(
                args.dataset_name,
                args.dataset_config_name,
                split=split,
                cache_dir=args.cache_dir,
                streaming=args.streaming,
            )
        except ValueError as error:
            if split != "validation" or "split" not in str(error).lower():
                raise
            raise InputError(
                f"dataset_name: {source} has no validation split ({first_line(error)}): give validation_files, the "
                "held-out stream a streaming run evaluates on"
            ) from None
    elif args.train_files:
        return _load_files(args, "train_files", args.train_files)
    else:
        return stdlib_corpus(args.corpus_max_bytes, args.text_column)
    columns = dataset.column_names  # (None for a stream whose features are known only once read)
    if columns is not None and args.text_column not in columns:
        raise ValueError(f"text_column: {args.text_column!r} is not a column of {source} ({columns})")
    return dataset


def _load_files(args: DataArguments, field: str, paths: list[str]) -> Dataset | IterableDataset:
    """The documents of local files (`field`: train_files or validation_files): JSON and Parquet through datasets'
    builders (a record is a document), text files through `text_documents` (split into documents); an unreadable
    file is one `InputError` naming it."""
    files = expand_files(paths, field)
    suffixes = {path.suffix for path in files}
    kinds = [(name, kind) for name, kind in KINDS if suffixes & kind]
    if len(kinds) > 1:
        raise ValueError(f"{field}: a mix of {' and '.join(name for name, _ in kinds)} files; give one kind")
    with quiet_datasets():
        try:
            if kinds[0][0] == "text":
                dataset = _text_dataset(args, files)
            else:
                dataset = load_dataset(
                    kinds[0][0].lower(),
                    data_files=[str(p) for p in files],
                    split="train",
                    cache_dir=args.cache_dir,
                    streaming=args.streaming,
                )
        except Exception as error:  # noqa: BLE001 - datasets wraps the cause (DatasetGenerationError, StopIteration...)
            raise InputError(bad_files(files, error, field)) from None
    columns = dataset.column_names
    if columns is not None and args.text_column not in columns:
        raise ValueError(f"text_column: {args.text_column!r} is not a column of {files[0]} ({columns})")
    if not args.streaming and not len(dataset):
        raise InputError(bad_files(files, ValueError("no document"), field))
    return dataset


KINDS = [("JSON", JSON_SUFFIXES), ("Parquet", PARQUET_SUFFIXES), ("text", TEXT_SUFFIXES)]


def _text_dataset(args: DataArguments, files: list[Path]) -> Dataset | IterableDataset:
    """The documents of text files (`text_documents`), as a dataset of column `text_column`: a stream, or written
    once under the datasets cache, named by the files' sizes and modification times and the separator (a changed
    file is read again)."""
    gen_kwargs = {
        "files": [str(path) for path in files],
        "stamps": [file_stamp(path)[1:] for path in files],  # (in the cache's name only)
        "column": args.text_column,
        "separator": args.text_document_separator,
    }
    features = Features({args.text_column: Value("string")})
    if args.streaming:
        return IterableDataset.from_generator(text_documents, features=features, gen_kwargs=gen_kwargs)
    fingerprint = Hasher.hash(["hf_p2r documents 1", gen_kwargs])
    return Dataset.from_generator(
        text_documents, features=features, cache_dir=args.cache_dir, gen_kwargs=gen_kwargs, fingerprint=fingerprint
    )


def text_documents(
    files: list[str], stamps: list, column: str = "text", separator: str | None = None
) -> Iterator[dict[str, str]]:
    """The documents of text `files` (a `datasets` generator; `stamps` only name its cache): each file read
    `READ_CHARS` characters at a time (universal newlines) and split at `separator` (`document_separator`); blank
    documents are skipped."""
    del stamps
    for name in files:
        split = document_separator(Path(name), separator)
        with open(name, encoding="utf-8") as file:
            if split is None:
                text = file.read()
                if text.strip():
                    yield {column: text}
                continue
            rest = ""
            while chunk := file.read(READ_CHARS):
                *documents, rest = split_documents(rest + chunk, split)
                for document in documents:
                    if document.strip():
                        yield {column: document}
            # Nothing follows the last part: split it whole (a blank-line separator's trailing whitespace was kept in
            # case the next piece went on).
            for document in [rest] if isinstance(split, str) else split.split(rest):
                if document.strip():
                    yield {column: document}


def document_separator(path: Path, separator: str | None) -> str | re.Pattern | None:
    """Where the text file `path` splits into documents: `BLANK_LINES` for .txt/.md/.rst and None (the whole file)
    for .py by default (`separator` None), None for '', else `separator` with its escapes (\\n, \\t, \\r, \\f, \\\\)
    read as the characters they name."""
    if separator is None:
        return BLANK_LINES if path.suffix in PROSE_SUFFIXES else None
    if not separator:
        return None
    escapes = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "\\": "\\"}
    return re.sub(r"\\([ntrf\\])", lambda match: escapes[match.group(1)], separator)


def split_documents(text: str, separator: str | re.Pattern) -> list[str]:
    """`text` split at `separator`; the last part may continue in the text that follows (the caller carries it): a
    blank-line separator ending in trailing whitespace, which may go on, is left in it."""
    if isinstance(separator, str):
        return text.split(separator)
    end = len(text.rstrip())
    parts = separator.split(text[:end])
    parts[-1] += text[end:]
    return parts


def file_stamp(path: Path) -> list:
    """[path, size in bytes, modification time in ns]: what `data_source` records of a file."""
    status = path.stat()
    return [str(path), status.st_size, status.st_mtime_ns]


@contextmanager
def quiet_datasets():
    """datasets logs a file it cannot parse before raising: the one line of `bad_files` says it instead."""
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)


def expand_files(paths: list[str], field: str = "train_files") -> list[Path]:
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{field}: {path} holds no {sorted(DATA_SUFFIXES)} files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{field}: {path} does not exist")
    return files


def bad_files(files: list[Path], error: Exception, field: str = "train_files") -> str:
    """Why `datasets` could not read `files`, in one line naming the file: looked for only once it has failed (the
    files are read again, on this error path alone)."""
    import pyarrow.parquet  # (datasets' own dependency)

    blank = []
    for path in files:
        if path.suffix in PARQUET_SUFFIXES:
            try:
                if not pyarrow.parquet.ParquetFile(path).metadata.num_rows:
                    blank.append(path)
            except Exception as bad:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
                return f"{field}: {path} is not a readable Parquet file ({first_line(bad)})"
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as bad:
            return (
                f"{field}: {path} is not UTF-8 text (byte 0x{data[bad.start]:02x} at offset {bad.start}): a binary "
                "file? give text (.txt, .md, .py, .rst), JSON lines (.json, .jsonl) or Parquet (.parquet) files"
            )
        if not text.strip():
            blank.append(path)
        elif path.suffix in JSON_SUFFIXES:
            for number, line in enumerate(text.splitlines(), 1):
                try:
                    line.strip() and json.loads(line)
                except ValueError as bad:
                    if number == 1 and path.suffix == ".json":
                        break  # one JSON document, not JSON lines: datasets' own message below
                    return f"{field}: {path} line {number} is not valid JSON ({bad})"
    if len(blank) == len(files):
        return f"{field}: {_names(blank)} empty or whitespace only: no text to train on"
    cause = error.__cause__ or error.__context__ or error
    return f"{field}: could not read {_names(files)} ({first_line(cause)})"


def first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _names(paths: list[Path]) -> str:
    return f"{shown_files(paths)} {'is' if len(paths) == 1 else 'are'}"


def shown_files(paths: list[Path]) -> str:
    shown = ", ".join(str(path) for path in paths[:3])
    return shown if len(paths) == 1 else f"{shown}{', ...' if len(paths) > 3 else ''} ({len(paths)} files)"
