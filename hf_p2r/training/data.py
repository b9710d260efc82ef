"""Data: text -> tokens -> fixed-length blocks, with a held-out validation split, all through `datasets`.

The default corpus needs no download: a deterministic subset of the Python standard library's `.py` files, which
every Python installation ships. The default tokenizer is built here: byte-level, 256 byte tokens (id = byte value)
plus two specials, saved next to every model so `AutoTokenizer.from_pretrained(output_dir / "real")` works.
"""

import hashlib
import json
import sysconfig
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from datasets.utils import logging as datasets_logging
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..errors import InputError
from .config import DataArguments

END_OF_TEXT, PAD = "<|endoftext|>", "<|pad|>"
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
JSON_SUFFIXES = {".json", ".jsonl"}


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


def load_documents(args: DataArguments) -> Dataset:
    """Raw documents: the Hub dataset, the local files, or the built-in corpus (in that order of precedence)."""
    if args.dataset_name:
        source = args.dataset_name
        dataset = load_dataset(args.dataset_name, args.dataset_config_name, split="train", cache_dir=args.cache_dir)
    elif args.train_files:
        files = _expand(args.train_files)
        source = files[0]
        suffixes = {path.suffix for path in files}
        if suffixes & JSON_SUFFIXES and not suffixes <= JSON_SUFFIXES:
            raise ValueError("train_files: a mix of JSON and text files; give one kind")
        builder, options = ("json", {}) if suffixes <= JSON_SUFFIXES else ("text", {"sample_by": "document"})
        # datasets logs a file it cannot parse before raising: the one line of `_bad_files` says it instead.
        verbosity = datasets_logging.get_verbosity()
        datasets_logging.set_verbosity(datasets_logging.CRITICAL)
        try:
            dataset = load_dataset(
                builder, data_files=[str(p) for p in files], split="train", cache_dir=args.cache_dir, **options
            )
        except Exception as error:  # noqa: BLE001 - datasets wraps the cause (DatasetGenerationError, StopIteration...)
            raise InputError(_bad_files(files, error)) from None
        finally:
            datasets_logging.set_verbosity(verbosity)
        if builder == "text" and args.text_column != "text":
            dataset = dataset.rename_column("text", args.text_column)
    else:
        return stdlib_corpus(args.corpus_max_bytes, args.text_column)
    if args.text_column not in dataset.column_names:
        raise ValueError(f"text_column: {args.text_column!r} is not a column of {source} ({dataset.column_names})")
    return dataset


def _expand(paths: list[str]) -> list[Path]:
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | JSON_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"train_files: {path} holds no {sorted(TEXT_SUFFIXES | JSON_SUFFIXES)} files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"train_files: {path} does not exist")
    return files


def _bad_files(files: list[Path], error: Exception) -> str:
    """Why `datasets` could not read `files`, in one line naming the file: looked for only once it has failed (the
    files are read again, on this error path alone)."""
    blank = []
    for path in files:
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as bad:
            return (
                f"train_files: {path} is not UTF-8 text (byte 0x{data[bad.start]:02x} at offset {bad.start}): a binary "
                "file? give text (.txt, .md, .py, .rst) or JSON lines (.json, .jsonl) files"
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
                    return f"train_files: {path} line {number} is not valid JSON ({bad})"
    if len(blank) == len(files):
        return f"train_files: {_names(blank)} empty or whitespace only: no text to train on"
    cause = error.__cause__ or error.__context__ or error
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
    return f"train_files: could not read {_names(files)} ({first})"


def _names(paths: list[Path]) -> str:
    shown = ", ".join(str(path) for path in paths[:3])
    return f"{shown} is" if len(paths) == 1 else f"{shown}{', ...' if len(paths) > 3 else ''} ({len(paths)} files) are"


def build_blocks(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets of `input_ids` blocks of `block_size` tokens, in torch format.

    Documents are shuffled (seeded), tokenized with an end-of-text token after each, concatenated and cut into
    blocks; the last `validation_fraction` of the blocks is held out, so validation text comes from documents that
    training never sees (except the one document that straddles the boundary).
    """
    documents = load_documents(args).shuffle(seed=seed)
    block_size, eos = args.block_size, tokenizer.eos_token_id
    column = args.text_column

    def tokenize_and_pack(batch):
        texts = [text for text in batch[column] if text and not text.isspace()]  # e.g. WikiText's blank lines
        ids = [token for tokens in tokenizer(texts)["input_ids"] for token in (*tokens, eos)] if texts else []
        usable = len(ids) // block_size * block_size  # the tail of each batch of documents is dropped
        return {"input_ids": [ids[start : start + block_size] for start in range(0, usable, block_size)]}

    blocks = documents.map(
        tokenize_and_pack,
        batched=True,
        remove_columns=documents.column_names,
        num_proc=args.preprocessing_num_workers,
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
            f"block_size: the corpus gives only {len(blocks)} blocks of {block_size} tokens; use more text "
            "(corpus_max_bytes, train_files) or a smaller block_size"
        )
    train = blocks.select(range(len(blocks) - num_validation)).with_format("torch")
    validation = blocks.select(range(len(blocks) - num_validation, len(blocks))).with_format("torch")
    return train, validation


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
