"""Data: text -> tokens -> fixed-length blocks, with a held-out validation split, all through `datasets`.

Two kinds of source:

- map-style (the default): the corpus is read, shuffled, tokenized and packed once, by the main process (the others
  wait, then read its cache file under the datasets cache: `build_blocks`), and training visits its blocks in a
  seeded order that is a pure function of the position (`BlockOrder`).
- streaming (`streaming: true`): a `datasets` `IterableDataset` over local JSON lines / Parquet / text shards or a Hub
  dataset, split per process with `split_dataset_by_node` and tokenized and packed on the fly (`stream_blocks`); its
  position is the dataset's `state_dict()`, saved with every checkpoint, so a resumed run reads exactly the blocks an
  uninterrupted one would have read. Validation reads a fixed held-out stream (`validation_files`, or the Hub
  dataset's validation split): its first `eval_blocks` blocks, the same for every evaluation and process count.

The default corpus needs no download: a deterministic subset of the Python standard library's `.py` files, which
every Python installation ships. The default tokenizer is built here: byte-level, 256 byte tokens (id = byte value)
plus two specials, saved next to every model so `AutoTokenizer.from_pretrained(output_dir / "real")` works.
"""

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import datasets
import torch
from datasets import Dataset, IterableDataset, load_dataset
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
JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}
DATA_SUFFIXES = TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES


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
    """The documents of local files (`field`: train_files or validation_files) through datasets' json, parquet or
    text builder (one document per text file); an unreadable file is one `InputError` naming it."""
    files = _expand(paths, field)
    suffixes = {path.suffix for path in files}
    kinds = [(name, kind) for name, kind in KINDS if suffixes & kind]
    if len(kinds) > 1:
        raise ValueError(f"{field}: a mix of {' and '.join(name for name, _ in kinds)} files; give one kind")
    builder, options = {"JSON": ("json", {}), "Parquet": ("parquet", {})}.get(kinds[0][0], ("text", {}))
    if builder == "text":
        options = {"sample_by": "document"}
    with _quiet_datasets():
        try:
            dataset = load_dataset(
                builder,
                data_files=[str(p) for p in files],
                split="train",
                cache_dir=args.cache_dir,
                streaming=args.streaming,
                **options,
            )
        except Exception as error:  # noqa: BLE001 - datasets wraps the cause (DatasetGenerationError, StopIteration...)
            raise InputError(_bad_files(files, error, field)) from None
    if builder == "text" and args.text_column != "text":
        dataset = dataset.rename_column("text", args.text_column)
    columns = dataset.column_names
    if columns is not None and args.text_column not in columns:
        raise ValueError(f"text_column: {args.text_column!r} is not a column of {files[0]} ({columns})")
    return dataset


KINDS = [("JSON", JSON_SUFFIXES), ("Parquet", PARQUET_SUFFIXES), ("text", TEXT_SUFFIXES)]


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


def packer(tokenizer: PreTrainedTokenizerBase, column: str, block_size: int) -> Callable[[dict], dict]:
    """The batched map that turns a batch of documents into blocks: each document's tokens then end-of-text,
    concatenated and cut into `block_size` tokens; the tail of each batch is dropped (less than one block)."""
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch):
        texts = [text for text in batch[column] if text and not text.isspace()]  # e.g. WikiText's blank lines
        ids = [token for tokens in tokenizer(texts)["input_ids"] for token in (*tokens, eos)] if texts else []
        usable = len(ids) // block_size * block_size
        return {"input_ids": [ids[start : start + block_size] for start in range(0, usable, block_size)]}

    return tokenize_and_pack


def build_blocks(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets of `input_ids` blocks of `block_size` tokens, in torch format.

    Documents are shuffled (seeded), tokenized with an end-of-text token after each, concatenated and cut into
    blocks; the last `validation_fraction` of the blocks is held out, so validation text comes from documents that
    training never sees (except the one document that straddles the boundary).

    The blocks are written once to a cache file named by what they are made of (`blocks_cache_file`): call it on the
    main process first (`accelerator.main_process_first()`) and the other processes read that file instead of
    tokenizing the corpus again.
    """
    documents = load_documents(args)
    cache_file, fingerprint = blocks_cache_file(args, documents, tokenizer, seed)
    documents = documents.shuffle(seed=seed)
    column = args.text_column
    blocks = documents.map(
        packer(tokenizer, column, args.block_size),
        batched=True,
        remove_columns=documents.column_names,
        num_proc=args.preprocessing_num_workers,
        cache_file_name=str(cache_file),
        new_fingerprint=fingerprint,
        desc="Tokenizing and packing",
    )
    num_validation = max(1, round(len(blocks) * args.validation_fraction))
    if len(blocks) - num_validation < 1:
        if not any(text and not text.isspace() for text in documents[column]):
            source = args.dataset_name or (_names(_expand(args.train_files)) if args.train_files else "the corpus is")
            raise InputError(
                f"{'dataset_name' if args.dataset_name else 'train_files'}: {source} empty or "
                "whitespace only: no text to train on"
            )
        raise ValueError(
            f"block_size: the corpus gives only {len(blocks)} blocks of {args.block_size} tokens; use more text "
            "(corpus_max_bytes, train_files) or a smaller block_size"
        )
    train = blocks.select(range(len(blocks) - num_validation)).with_format("torch")
    validation = blocks.select(range(len(blocks) - num_validation, len(blocks))).with_format("torch")
    return train, validation


def blocks_cache_file(
    args: DataArguments, documents: Dataset, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[Path, str]:
    """(the cache file of the packed blocks, its fingerprint): under `cache_dir` (default: the datasets cache),
    named by a hash of the documents (their cache files, or their text when held in memory: the built-in corpus),
    the tokenizer, `text_column`, `block_size` and the seed, so every process of a run names the same file and any
    change names another."""
    if documents.cache_files:
        made_of = [(f["filename"], os.stat(f["filename"]).st_size) for f in documents.cache_files]
    else:
        made_of = hashlib.sha256("\0".join(documents[args.text_column]).encode()).hexdigest()
    fingerprint = Hasher.hash(["hf_p2r blocks 1", made_of, tokenizer, args.text_column, args.block_size, seed])
    folder = Path(args.cache_dir or datasets.config.HF_DATASETS_CACHE) / "hf_p2r"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"blocks-{fingerprint}.arrow", fingerprint


def stream_blocks(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, data_rank: int, data_size: int, eval_blocks: int
) -> tuple["BlockStream", Dataset]:
    """(this process's training blocks, the validation blocks) of a streaming source (`args.streaming`).

    Training: the documents split with `split_dataset_by_node` (`data_rank` of `data_size`: whole shards per process
    when their number is a multiple of `data_size`, else every `data_size`-th document), then tokenized and packed
    on the fly (`packer`, batches of 1,000 documents) as this process reads them, in the shards' order: no shuffle
    buffer (datasets drops its contents on resume, which would break the exact resume), so give shuffled shards.
    Validation: the first `eval_blocks` blocks of the held-out stream (`load_documents(args, "validation")`), read
    once, not split: the same blocks for every evaluation whatever the number of processes. The first training block
    is read now, so a shard that cannot be read or a stream without a block is told before the run changes anything
    (a shard first read later stops the run when it is reached, in one line naming it).
    """
    column, pack = args.text_column, packer(tokenizer, args.text_column, args.block_size)

    def packed(documents: IterableDataset) -> IterableDataset:
        return documents.select_columns([column]).map(pack, batched=True, remove_columns=[column])

    source = args.dataset_name or _shown(_expand(args.train_files))
    field = "dataset_name" if args.dataset_name else "train_files"
    documents = split_dataset_by_node(load_documents(args), rank=data_rank, world_size=data_size)
    train = BlockStream(packed(documents), _describer(args, field, source))
    train.check()
    held_out = "validation_files" if args.validation_files else "dataset_name"
    held_out_source = _shown(_expand(args.validation_files, held_out)) if args.validation_files else source
    validation = BlockStream(packed(load_documents(args, "validation")), _describer(args, held_out, held_out_source))
    rows = validation.head(eval_blocks)
    return train, Dataset.from_dict({"input_ids": rows}).with_format("torch")


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
    the packed batch; JSON), `load_state_dict` resumes from it: the next block is the one that followed. The packer
    keeps no tokens between its batches (each batch's tail is dropped), so the dataset's state is the whole position.
    A read that fails is one `InputError` (`describe(error)`: naming the field and the file).
    """

    def __init__(self, dataset: IterableDataset, describe: Callable[[Exception], str]):
        self.dataset, self.describe = dataset, describe
        self._rows: Iterator[dict] | None = None
        self._start: dict | None = None  # the loaded state, until reading starts from it
        self._read_this_epoch = 0

    def take(self, count: int) -> torch.Tensor:
        """The next `count` blocks, a `count x block_size` LongTensor (across the end of an epoch)."""
        rows = []
        while len(rows) < count:
            if self._rows is None:
                self._rows = self._read()
            with _quiet_datasets():
                row = next(self._rows, None)
            if row is None:  # the end of this epoch: the next one starts
                if not self._read_this_epoch and self._start is None:
                    raise InputError(self.describe(EmptyStreamError()))
                self.dataset.set_epoch(self.dataset.epoch + 1)
                self._rows, self._start, self._read_this_epoch = None, None, 0
                continue
            self._read_this_epoch += 1
            rows.append(row["input_ids"])
        return torch.tensor(rows, dtype=torch.long)

    def head(self, count: int) -> list[list[int]]:
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
        return self._start if self._start is not None else self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.set_epoch(state["epoch"])
        self.dataset.load_state_dict(state)
        self._rows, self._start, self._read_this_epoch = None, state, 0

    def resume(self, states: list[dict], process_index: int, num_processes: int, checkpoint: Path) -> None:
        """Continue from this process's entry of `states` (every process's `state_dict()`, by process index, as a
        checkpoint keeps them)."""
        if len(states) != num_processes:
            raise InputError(
                f"resume_from_checkpoint: {checkpoint} holds the stream positions of {len(states)} processes, this "
                f"run has {num_processes}: a streaming run resumes on as many processes as it saved"
            )
        if not isinstance(states[process_index].get("epoch"), int):
            raise InputError(f"resume_from_checkpoint: {checkpoint} has no stream position of process {process_index}")
        self.load_state_dict(states[process_index])

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
    processes of a data-parallel run can each take their slice of the same global batch.
    """

    def __init__(self, num_blocks: int, seed: int):
        self.num_blocks, self.seed = num_blocks, seed
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
