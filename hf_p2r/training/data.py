"""Data: text -> documents -> tokens -> fixed-length blocks, with a validation split held out by document, all through
`datasets`.

Two kinds of source:

- map-style (the default): the corpus is read, split into documents, shuffled, split into training and validation
  documents (`validation_fraction` of the text, whole documents), tokenized and packed once, by the main process (the
  others wait, then read its cache files under the datasets cache: `build_blocks`), and training visits its blocks in
  a seeded order that is a pure function of the position (`BlockOrder`).
- streaming (`streaming: true`): a `datasets` `IterableDataset` over local JSON lines / Parquet / text shards or a Hub
  dataset, split per process with `split_dataset_by_node` and tokenized and packed on the fly (`stream_blocks`); its
  position is the dataset's `state_dict()`, saved with every checkpoint, so a resumed run reads exactly the blocks an
  uninterrupted one would have read. Validation reads a fixed held-out stream (`validation_files`, or the Hub
  dataset's validation split): its first `eval_blocks` blocks, the same for every evaluation and process count.

Documents: a JSON / Parquet / Hub record is one; a text file is split at blank lines (.txt, .md, .rst: a line holding
only whitespace ends a document) or kept whole (.py), or at `text_document_separator` when it is given ('' keeps every
file whole). A document is tokenized in pieces of at most `CHUNK_CHARS` characters, cut before a space or at a line
start (`cut_point`: the same tokens as the whole document's for the byte-level and GPT-2/Llama-3-style BPE tokenizers,
where a piece holds such a place; a SentencePiece-style one may differ by a token at a cut), so the memory a run needs
does not grow with the size of a document.

What a run's data position refers to (`data_source`: the files with their sizes and modification times, the Hub
dataset, or the built-in corpus's digest) is kept with the position in every checkpoint (`BlockOrder.state_dict`,
`BlockStream.state_dict`); a resume on other data is refused in one line, or warned about with `allow_data_change`.

The default corpus needs no download: a deterministic subset of the Python standard library's `.py` files, which
every Python installation ships. The default tokenizer is built here: byte-level, 256 byte tokens (id = byte value)
plus two specials, saved next to every model as a plain `tokenizer.json`, so `AutoTokenizer.from_pretrained(folder)`
loads it with transformers alone.
"""

import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, Features, IterableDataset, Value, load_dataset
from datasets.distributed import split_dataset_by_node
from datasets.fingerprint import Hasher
from datasets.utils import logging as datasets_logging
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..errors import InputError
from .config import DataArguments

END_OF_TEXT, PAD = "<|endoftext|>", "<|pad|>"
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
PROSE_SUFFIXES = {".txt", ".md", ".rst"}  # split at blank lines by default; a .py file is one document
JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}
DATA_SUFFIXES = TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES
BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line break, then one or more lines of whitespace only
CHUNK_CHARS = 1 << 16  # the most characters tokenized as one piece of a document
PACK_CHUNKS = 16  # chunks (of at most CHUNK_CHARS) per packed batch: 1 MiB of text, whose tail (< 1 block) is dropped
READ_CHARS = 1 << 20  # a text file is read this many characters at a time


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Every text round-trips; token i < 256 is byte i, then `<|endoftext|>` (256, bos/eos) and `<|pad|>` (257)."""
    # ByteLevel maps each byte to a printable character; a BPE without merges then emits one token per byte.
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([END_OF_TEXT, PAD])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD
    )


def load_tokenizer(name_or_path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer at `name_or_path` (folder or Hub name), or the built-in byte-level one for None."""
    if name_or_path is None:
        return byte_level_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer_name: {name_or_path} has no eos token, needed to separate packed documents")
    return tokenizer


def stdlib_corpus(max_bytes: int, column: str = "text") -> Dataset:
    """Python standard-library sources, about `max_bytes` of them, as a dataset with one file per row.

    Files are taken in the order of a hash of their relative path (a fixed, well-mixed order; the same on every
    machine with the same Python version), skipping tests, third-party packages and any file that would take the
    total past `max_bytes`.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(path.relative_to(root).parts)
    ]
    files.sort(key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        size = len(text.encode())
        if total + size <= max_bytes:  # skip files that would overflow the budget, keep filling with smaller ones
            texts.append(text)
            total += size
    if not texts:
        raise FileNotFoundError(
            f"corpus_max_bytes: no Python source under {root} fits in {max_bytes} bytes; set train_files"
        )
    return Dataset.from_dict({column: texts})


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
                f"dataset_name: {source} has no validation split ({_first_line(error)}): give validation_files, the "
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
    files = _expand(paths, field)
    suffixes = {path.suffix for path in files}
    kinds = [(name, kind) for name, kind in KINDS if suffixes & kind]
    if len(kinds) > 1:
        raise ValueError(f"{field}: a mix of {' and '.join(name for name, _ in kinds)} files; give one kind")
    with _quiet_datasets():
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
            raise InputError(_bad_files(files, error, field)) from None
    columns = dataset.column_names
    if columns is not None and args.text_column not in columns:
        raise ValueError(f"text_column: {args.text_column!r} is not a column of {files[0]} ({columns})")
    if not args.streaming and not len(dataset):
        raise InputError(_bad_files(files, ValueError("no document"), field))
    return dataset


KINDS = [("JSON", JSON_SUFFIXES), ("Parquet", PARQUET_SUFFIXES), ("text", TEXT_SUFFIXES)]


def _text_dataset(args: DataArguments, files: list[Path]) -> Dataset | IterableDataset:
    """The documents of text files (`text_documents`), as a dataset of column `text_column`: a stream, or written
    once under the datasets cache, named by the files' sizes and modification times and the separator (a changed
    file is read again)."""
    gen_kwargs = {
        "files": [str(path) for path in files],
        "stamps": [_stamp(path)[1:] for path in files],  # (in the cache's name only)
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
            if rest.strip():
                yield {column: rest}


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


def _stamp(path: Path) -> list:
    """[path, size in bytes, modification time in ns]: what `data_source` records of a file."""
    status = path.stat()
    return [str(path), status.st_size, status.st_mtime_ns]


@contextmanager
def _quiet_datasets():
    """datasets logs a file it cannot parse before raising: the one line of `_bad_files` says it instead."""
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)


def _expand(paths: list[str], field: str = "train_files") -> list[Path]:
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


def _bad_files(files: list[Path], error: Exception, field: str = "train_files") -> str:
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
                return f"{field}: {path} is not a readable Parquet file ({_first_line(bad)})"
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
    return f"{field}: could not read {_names(files)} ({_first_line(cause)})"


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _names(paths: list[Path]) -> str:
    return f"{_shown(paths)} {'is' if len(paths) == 1 else 'are'}"


def _shown(paths: list[Path]) -> str:
    shown = ", ".join(str(path) for path in paths[:3])
    return shown if len(paths) == 1 else f"{shown}{', ...' if len(paths) > 3 else ''} ({len(paths)} files)"


def chunker(column: str, chunk_chars: int = CHUNK_CHARS) -> Callable[[dict], dict]:
    """The batched map that groups a batch of documents into chunks of at most `chunk_chars` characters: a chunk is
    consecutive documents, or pieces of them (`segments`, with `starts` / `ends`: whether a segment starts or ends its
    document). A document longer than `chunk_chars` is cut into pieces (`cut_point`); blank documents are skipped."""

    def chunk(batch: dict) -> dict:
        rows = {"segments": [], "starts": [], "ends": []}
        current = {"segments": [], "starts": [], "ends": []}
        size = 0

        def close():
            nonlocal size
            if current["segments"]:
                for key, values in current.items():
                    rows[key].append(values.copy())
                    values.clear()
            size = 0

        for text in batch[column]:
            if not text or text.isspace():  # e.g. WikiText's blank lines
                continue
            if size + len(text) > chunk_chars:
                close()
            start = 0
            while len(text) - start > chunk_chars:
                cut = cut_point(text, start, start + chunk_chars)
                for key, value in zip(current, (text[start:cut], start == 0, False)):
                    current[key].append(value)
                close()
                start = cut
            for key, value in zip(current, (text[start:], start == 0, True)):
                current[key].append(value)
            size += len(text) - start
        close()
        return rows

    return chunk


def cut_point(text: str, start: int, end: int) -> int:
    """Where to end a piece of `text` that starts at `start` and may not reach `end`: before the last space in
    (start, end) that a character other than whitespace follows, else at the start of the last line that begins with
    one after one (a line break between two such characters), else at `end`. No pre-tokenizer of the byte-level,
    GPT-2/Llama-3 (regex) or whitespace kinds joins across the first two: the pieces' tokens are the whole text's."""
    space = text.rfind(" ", start + 1, end)
    while space > start:
        if space + 1 < len(text) and not text[space + 1].isspace():
            return space
        space = text.rfind(" ", start + 1, space)
    newline = text.rfind("\n", start + 1, end - 1)
    while newline > start:
        if not text[newline + 1].isspace() and not text[newline - 1].isspace():
            return newline + 1
        newline = text.rfind("\n", start + 1, newline)
    return end


def packer(tokenizer: PreTrainedTokenizerBase, block_size: int) -> Callable[[dict], dict]:
    """The batched map that turns a batch of chunks (`chunker`'s) into blocks: each document's tokens then
    end-of-text, concatenated and cut into `block_size` tokens; the tail of each batch is dropped (less than one
    block). A whole document is tokenized as the tokenizer does (special tokens included); the pieces of a long one
    without its special tokens, which are put where the tokenizer puts them (before its first piece, after its last)."""
    eos = tokenizer.eos_token_id
    specials: list[tuple[list[int], list[int]]] = []  # (before, after) a document's tokens: found when first needed

    def special_tokens() -> tuple[list[int], list[int]]:
        if not specials:
            bare = tokenizer("a", add_special_tokens=False)["input_ids"]
            full = tokenizer("a")["input_ids"]
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
            specials.append((full[:at], full[at + len(bare) :]) if at is not None else ([], []))
        return specials[0]

    def tokenize_and_pack(batch: dict) -> dict:
        segments = [
            (text, starts, ends)
            for texts, starts_row, ends_row in zip(batch["segments"], batch["starts"], batch["ends"])
            for text, starts, ends in zip(texts, starts_row, ends_row)
        ]
        whole = [text for text, first, last in segments if first and last]
        pieces = [text for text, first, last in segments if not (first and last)]
        whole_ids = iter(tokenizer(whole, return_attention_mask=False)["input_ids"] if whole else [])
        piece_ids = iter(
            tokenizer(pieces, add_special_tokens=False, return_attention_mask=False)["input_ids"] if pieces else []
        )
        ids = []
        for _, first, last in segments:
            if first and last:
                ids += next(whole_ids)
            else:
                before, after = special_tokens()
                ids += (before if first else []) + next(piece_ids) + (after if last else [])
            if last:
                ids.append(eos)
        usable = len(ids) // block_size * block_size
        return {"input_ids": np.array(ids[:usable], dtype=np.int64).reshape(-1, block_size)}

    return tokenize_and_pack


def tokenized_blocks(
    documents: Dataset | IterableDataset, tokenizer: PreTrainedTokenizerBase, args: DataArguments, **cache
) -> Dataset | IterableDataset:
    """The blocks of `documents` (`chunker`, then `packer`); `cache`: `cache_file` and `fingerprint` of a map-style
    dataset's two cache files (`chunks-*`, `blocks-*`), the tokenizing processes (`num_proc`)."""
    column = args.text_column
    documents = documents.select_columns([column])
    stages = [
        ("chunks", chunker(column), {"remove_columns": [column]}),
        ("blocks", packer(tokenizer, args.block_size), {"remove_columns": ["segments", "starts", "ends"]}),
    ]
    data = documents
    for name, function, options in stages:
        if name == "blocks":
            options["batch_size"] = PACK_CHUNKS
        if isinstance(data, Dataset):
            options |= {
                "cache_file_name": str(cache["cache_file"]).replace("blocks-", f"{name}-"),
                "new_fingerprint": f"{cache['fingerprint']}-{name}",
                "num_proc": cache.get("num_proc") if name == "blocks" else None,
                "desc": "Tokenizing and packing" if name == "blocks" else "Cutting documents into chunks",
            }
        data = data.map(function, batched=True, **options)
    return data


class Blocks(tuple):
    """(train, validation): the training blocks (a torch-format `Dataset`, or this process's `BlockStream`) and the
    validation blocks (a torch-format `Dataset`), with `source` (`data_source`: what the data position refers to)
    and `report` (what each split holds, in lines for the run's start)."""

    def __new__(cls, train, validation, *, source: dict, report: str, allow_change: bool = False):
        blocks = super().__new__(cls, (train, validation))
        blocks.source, blocks.report, blocks.allow_change = source, report, allow_change
        return blocks

    def position(self, seed: int) -> "BlockStream | BlockOrder":
        """What holds the training data's position (its `state_dict()` goes into checkpoints, `resume` checks it):
        the stream itself, or the seeded order of the map-style blocks."""
        if isinstance(self.train, BlockStream):
            return self.train
        return BlockOrder(len(self.train), seed, self.source, self.allow_change)

    @property
    def train(self):
        return self[0]

    @property
    def validation(self):
        return self[1]


def build_blocks(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> Blocks:
    """(train, validation) datasets of `input_ids` blocks of `block_size` tokens, in torch format (a `Blocks`).

    Documents are shuffled (seeded) and the last of them, `validation_fraction` of the text (whole documents; at least
    one, and one left to train on), held out for validation: training never sees a validation document. Each split
    is then tokenized with an end-of-text token after each document, concatenated and cut into blocks.

    The blocks are written once to cache files named by what they are made of (`blocks_cache_file`): call it on the
    main process first (`accelerator.main_process_first()`) and the other processes read those files instead of
    tokenizing the corpus again.
    """
    documents = load_documents(args)
    field = "dataset_name" if args.dataset_name else "train_files"
    source = args.dataset_name or (_shown(_expand(args.train_files)) if args.train_files else "the built-in corpus")
    if not len(documents):
        raise InputError(f"{field}: {source} holds no document: no text to train on")
    if len(documents) < 2:
        raise InputError(
            f"{field}: {source} holds one document, and validation is held out by document: give more documents"
            + (" (text_document_separator: where a text file splits into documents)" if args.train_files else "")
        )
    cache_file, fingerprint = blocks_cache_file(args, documents, tokenizer, seed)
    lengths = pc.utf8_length(documents.data.column(args.text_column)).to_numpy(zero_copy_only=False)
    order = np.random.default_rng(seed).permutation(len(documents))
    held_out = np.cumsum(lengths[order[::-1]]) < args.validation_fraction * lengths.sum()
    num_validation = min(max(1, int(held_out.sum()) + 1), len(documents) - 1)
    splits = {"train": order[:-num_validation], "validation": order[-num_validation:]}
    blocks, counts = {}, {}
    for name, indices in splits.items():
        selected = documents.select(indices)
        counts[name] = len(selected)
        blocks[name] = tokenized_blocks(
            selected,
            tokenizer,
            args,
            cache_file=str(cache_file).replace(".arrow", f"-{name}.arrow"),
            fingerprint=f"{fingerprint}-{name}",
            num_proc=args.preprocessing_num_workers,
        ).with_format("torch")
    if not len(blocks["train"]) or not len(blocks["validation"]):
        raise ValueError(
            f"block_size: the corpus gives only {len(blocks['train'])} training and {len(blocks['validation'])} "
            f"validation blocks of {args.block_size} tokens; use more text (corpus_max_bytes, train_files) or a "
            "smaller block_size"
        )
    report = "\n".join(
        f"data: {name} {counts[name]:,} documents, {len(blocks[name]) * args.block_size:,} tokens in "
        f"{len(blocks[name]):,} blocks of {args.block_size}"
        + (f" (held out by document: {args.validation_fraction:.0%} of the text)" if name == "validation" else "")
        for name in splits
    )
    if args.train_files:
        files = _expand(args.train_files)
        size = sum(path.stat().st_size for path in files)
        count = f"{len(files)} file{'s' if len(files) > 1 else ''}"
        report = f"data: train_files: {count}, {size:,} bytes; {_splitting(args, files)}\n{report}"
    record = data_source(args, documents)
    return Blocks(
        blocks["train"], blocks["validation"], source=record, report=report, allow_change=args.allow_data_change
    )


def _splitting(args: DataArguments, files: list[Path]) -> str:
    """How the files of a run became documents, in words."""
    if not {path.suffix for path in files} & TEXT_SUFFIXES:
        return f"one document per record ({args.text_column!r})"
    separator = args.text_document_separator
    if separator is None:
        return "text files split into documents at blank lines (.py files: one document each)"
    return f"text files split into documents at {separator!r}" if separator else "one document per text file"


def blocks_cache_file(
    args: DataArguments, documents: Dataset, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[Path, str]:
    """(the cache file of the packed blocks, its fingerprint): under `cache_dir` (default: the datasets cache),
    named by a hash of the documents (their cache files, or their text when held in memory: the built-in corpus),
    the tokenizer, `text_column`, `block_size`, `validation_fraction` and the seed, so every process of a run names
    the same file and any change names another."""
    fingerprint = Hasher.hash(
        [
            "hf_p2r blocks 2",
            _made_of(args, documents),
            tokenizer,
            args.text_column,
            args.block_size,
            args.validation_fraction,
            seed,
        ]
    )
    folder = Path(args.cache_dir or datasets.config.HF_DATASETS_CACHE) / "hf_p2r"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"blocks-{fingerprint}.arrow", fingerprint


def _made_of(args: DataArguments, documents: Dataset):
    """What names a map-style dataset's content: its cache files and their sizes, or its text's digest."""
    if documents.cache_files:
        return [(f["filename"], os.stat(f["filename"]).st_size) for f in documents.cache_files]
    return hashlib.sha256("\0".join(documents[args.text_column]).encode()).hexdigest()


def data_source(args: DataArguments, documents: Dataset | None = None) -> dict:
    """What a run's data position refers to: `train_files` (each file's path, size in bytes and modification time in
    ns), the Hub dataset's name and configuration, or the built-in corpus's digest (from its `documents`)."""
    if args.dataset_name:
        return {"dataset_name": args.dataset_name, "dataset_config_name": args.dataset_config_name}
    if args.train_files:
        return {"train_files": [_stamp(path) for path in _expand(args.train_files)]}
    documents = documents if documents is not None else load_documents(args)
    return {"corpus": _made_of(args, documents)}


def data_changes(saved: dict, now: dict) -> str | None:
    """How the data `now` (`data_source`) differs from the `saved` one, in words; None when they are the same."""
    if saved == now:
        return None
    if set(saved) != set(now) or "train_files" not in now:
        return f"{_brief(saved)} then, {_brief(now)} now"
    before, after = ({name: (size, mtime) for name, size, mtime in record["train_files"]} for record in (saved, now))
    changes = [f"{_printable(name)} is gone" for name in before if name not in after]
    changes += [f"{_printable(name)} is new" for name in after if name not in before]
    for name in (name for name in before if name in after):
        (size, mtime), (new_size, new_mtime) = before[name], after[name]
        if size != new_size:
            changes.append(f"{_printable(name)}: {size:,} bytes then, {new_size:,} now")
        elif mtime != new_mtime:
            changes.append(f"{_printable(name)}: modified (same size)")
    if not changes:
        return "the order of train_files"
    return "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")


def _brief(source: dict) -> str:
    if "train_files" in source:
        return f"train_files ({len(source['train_files'])} files)"
    if "dataset_name" in source:
        return f"dataset_name {source['dataset_name']}"
    return "the built-in corpus" + (f" (digest {str(source['corpus'])[:12]})" if "corpus" in source else "")


def _printable(text: str) -> str:
    """`text` with its control characters escaped (a file name with a line break prints on one line)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def check_data_change(saved: dict | None, now: dict, checkpoint: Path, allow: bool) -> str | None:
    """Refuse (`InputError`) a resume from `checkpoint` whose data (`saved`, `data_source`) differs from this run's
    (`now`); with `allow` (`allow_data_change`), the one-line warning to show instead. None when they agree, or when
    the checkpoint recorded no data (saved by an earlier hf-p2r)."""
    changes = None if saved is None else data_changes(saved, now)
    if changes is None:
        return None
    if allow:
        return f"warning: the training data changed since {checkpoint} was saved ({changes}); resuming on it anyway"
    raise InputError(
        f"resume_from_checkpoint: the training data changed since {checkpoint} was saved ({changes}): the data "
        "position it holds would point into other data; restore the data, or pass --allow_data_change to resume on it"
    )


def check_output_dir_outside_data(args: DataArguments, output_dir: str | Path) -> None:
    """Refuse an `output_dir` inside a folder of `train_files` or `validation_files`: the next run would read the
    run's own files (metrics.jsonl, README.md...) as data."""
    output = Path(output_dir).resolve()
    for field in ("train_files", "validation_files"):
        for name in getattr(args, field):
            folder = Path(name)
            if folder.is_dir() and output.is_relative_to(folder.resolve()):
                raise InputError(
                    f"output_dir: {_printable(str(output_dir))} is inside {_printable(name)}, a folder of {field}: "
                    "the next run would read this run's files as data; write the run elsewhere"
                )


def stream_blocks(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, data_rank: int, data_size: int, eval_blocks: int
) -> Blocks:
    """(this process's training blocks, the validation blocks) of a streaming source (`args.streaming`).

    Training: the documents split with `split_dataset_by_node` (`data_rank` of `data_size`: whole shards per process
    when their number is a multiple of `data_size`, else every `data_size`-th document), then tokenized and packed
    on the fly (`tokenized_blocks`) as this process reads them, in the shards' order: no shuffle buffer (datasets
    drops its contents on resume, which would break the exact resume), so give shuffled shards.
    Validation: the first `eval_blocks` blocks of the held-out stream (`load_documents(args, "validation")`), read
    once, not split: the same blocks for every evaluation whatever the number of processes. The first training block
    is read now, so a shard that cannot be read or a stream without a block is told before the run changes anything
    (a shard first read later stops the run when it is reached, in one line naming it).
    """
    source = args.dataset_name or _shown(_expand(args.train_files))
    field = "dataset_name" if args.dataset_name else "train_files"
    documents = split_dataset_by_node(load_documents(args), rank=data_rank, world_size=data_size)
    record = data_source(args)
    train = BlockStream(
        tokenized_blocks(documents, tokenizer, args), _describer(args, field, source), record, args.allow_data_change
    )
    train.check()
    held_out = "validation_files" if args.validation_files else "dataset_name"
    held_out_source = _shown(_expand(args.validation_files, held_out)) if args.validation_files else source
    validation = BlockStream(
        tokenized_blocks(load_documents(args, "validation"), tokenizer, args),
        _describer(args, held_out, held_out_source),
    )
    rows = validation.head(eval_blocks)
    files = f", {sum(size for _, size, _ in record['train_files']):,} bytes" if args.train_files else ""
    report = (
        f"data: train streamed from {field} {source}{files}, split over {data_size} process(es) and tokenized as it is "
        "read (its documents and tokens are not counted ahead)\n"
        f"data: validation the first {len(rows):,} blocks of {args.block_size} ({len(rows) * args.block_size:,} "
        f"tokens) of {held_out} {held_out_source}"
    )
    return Blocks(train, _torch_blocks(rows), source=record, report=report)


def _torch_blocks(rows: list) -> Dataset:
    return Dataset.from_dict({"input_ids": np.asarray(rows, dtype=np.int64)}).with_format("torch")


def _describer(args: DataArguments, field: str, source: str) -> Callable[[Exception], str]:
    """What a streaming source's read error says, in one line naming the field and the file."""

    def describe(error: Exception) -> str:
        if isinstance(error, EmptyStreamError):
            return f"{field}: {source} holds no block of {args.block_size} tokens (empty, blank, or less text than one)"
        if isinstance(error, KeyError) and args.text_column in str(error):
            return f"text_column: {args.text_column!r} is not a column of {source}"
        if field != "dataset_name":
            paths = args.validation_files if field == "validation_files" else args.train_files
            with _quiet_datasets():
                return _bad_files(_expand(paths, field), error, field)
        return f"{field}: could not read {source} ({_first_line(error)})"

    return describe


class BlockStream:
    """Blocks read in order from a streaming dataset (an `IterableDataset` of `input_ids` rows), restarted at its
    next epoch when it ends (`IterableDataset.set_epoch`, which may reorder the shards), with an exact position.

    `state_dict()` is the dataset's own (`IterableDataset.state_dict`: the shard, the example in it, the block within
    the packed batch; JSON) plus `source`, what it refers to (`data_source`); `load_state_dict` resumes from it: the
    next block is the one that followed. The packer keeps no tokens between its batches (each batch's tail is
    dropped), so the dataset's state is the whole position. A read that fails is one `InputError`
    (`describe(error)`: naming the field and the file).
    """

    def __init__(
        self,
        dataset: IterableDataset,
        describe: Callable[[Exception], str],
        source: dict | None = None,
        allow_change: bool = False,
    ):
        self.dataset, self.describe, self.source, self.allow_change = dataset, describe, source, allow_change
        self._rows: Iterator[dict] | None = None
        self._start: dict | None = None  # the loaded state, until reading starts from it
        self._read_this_epoch = 0

    def take(self, count: int) -> torch.Tensor:
        """The next `count` blocks, a `count x block_size` LongTensor (across the end of an epoch)."""
        rows = []
        with _quiet_datasets():  # (once per call: setting the verbosity clears every logger's cache)
            while len(rows) < count:
                if self._rows is None:
                    self._rows = self._read()
                row = next(self._rows, None)
                if row is None:  # the end of this epoch: the next one starts
                    if not self._read_this_epoch and self._start is None:
                        raise InputError(self.describe(EmptyStreamError()))
                    self.dataset.set_epoch(self.dataset.epoch + 1)
                    self._rows, self._start, self._read_this_epoch = None, None, 0
                    continue
                self._read_this_epoch += 1
                rows.append(row["input_ids"])
        return torch.from_numpy(np.asarray(rows, dtype=np.int64))

    def head(self, count: int) -> list:
        """The first `count` blocks of the stream (fewer if it has fewer; at least one), from a fresh read."""
        with _quiet_datasets():
            rows = [row["input_ids"] for row in islice(self._read(), count)]
        if not rows:
            raise InputError(self.describe(EmptyStreamError()))
        return rows

    def check(self) -> None:
        """Read the first block (its shard opens, parses and holds a block), then start again from the beginning."""
        self.head(1)

    def state_dict(self) -> dict:
        state = self._start if self._start is not None else self.dataset.state_dict()
        return {**state, "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        state = {key: value for key, value in state.items() if key != "source"}
        self.dataset.set_epoch(state["epoch"])
        self.dataset.load_state_dict(state)
        self._rows, self._start, self._read_this_epoch = None, state, 0

    def resume(self, states: list[dict], process_index: int, num_processes: int, checkpoint: Path) -> str | None:
        """Continue from this process's entry of `states` (every process's `state_dict()`, by process index, as a
        checkpoint keeps them), after checking that it refers to this run's data (`check_data_change`): returns the
        warning to show when it does not and `allow_data_change` is set."""
        if len(states) != num_processes:
            raise InputError(
                f"resume_from_checkpoint: {checkpoint} holds the stream positions of {len(states)} processes, this "
                f"run has {num_processes}: a streaming run resumes on as many processes as it saved"
            )
        state = states[process_index]
        if not isinstance(state.get("epoch"), int):
            raise InputError(f"resume_from_checkpoint: {checkpoint} has no stream position of process {process_index}")
        warning = check_data_change(state.get("source"), self.source, checkpoint, self.allow_change)
        self.load_state_dict(state)
        return warning

    def _read(self) -> Iterator[dict]:
        rows = iter(self.dataset)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except InputError:
                raise
            except Exception as error:  # noqa: BLE001 - any failure of a shard's read: one line naming it
                raise InputError(self.describe(error)) from None
            yield row


class EmptyStreamError(Exception):
    """A stream that gives no block."""

    def __str__(self) -> str:
        return "no block: empty, blank, or less text than one block"


class BlockOrder:
    """The order in which training visits the blocks: epoch e is the permutation drawn from `seed + e`.

    Block i of the run is a pure function of i, so a run resumes exactly from one integer (blocks consumed), and the
    processes of a data-parallel run can each take their slice of the same global batch. `state_dict()` records what
    the blocks are made of (`source`: `data_source`), which a resume checks (`resume`).
    """

    def __init__(self, num_blocks: int, seed: int, source: dict | None = None, allow_change: bool = False):
        self.num_blocks, self.seed, self.source, self.allow_change = num_blocks, seed, source, allow_change
        self._epoch, self._permutation = -1, torch.empty(0, dtype=torch.long)

    def indices(self, start: int, count: int) -> list[int]:
        """Block indices at positions start, start + 1, ..., start + count - 1 of the run."""
        out = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.num_blocks)
            if epoch != self._epoch:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._epoch, self._permutation = epoch, torch.randperm(self.num_blocks, generator=generator)
            out.append(int(self._permutation[offset]))
        return out

    def state_dict(self) -> dict:
        """What the position (the checkpoint's `blocks_consumed`) refers to."""
        return {"source": self.source, "num_blocks": self.num_blocks}

    def resume(self, states: list[dict], process_index: int, num_processes: int, checkpoint: Path) -> str | None:
        """Check that a checkpoint's `states` (every process's `state_dict()`; none from an earlier hf-p2r) refer to
        this run's data (`check_data_change`): returns the warning to show when they do not and `allow_data_change`
        is set."""
        del num_processes
        saved = states[min(process_index, len(states) - 1)].get("source") if states else None
        return check_data_change(saved, self.source, checkpoint, self.allow_change)
