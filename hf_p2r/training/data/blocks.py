"""Map-style blocks: the corpus split by document into training and validation, tokenized and packed once into cache
files (`build_blocks`), visited in a seeded order that is a pure function of the position (`BlockOrder`)."""

from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from ...config import DataArguments
from ...errors import InputError
from .documents import TEXT_SUFFIXES, expand_files, load_documents, shown_files
from .packing import tokenized_blocks
from .source import check_data_change, data_source, made_of


class Blocks(tuple):
    """(train, validation): the training blocks (a torch-format `Dataset`, or this process's `BlockStream`) and the
    validation blocks (a torch-format `Dataset`), with `source` (`data_source`: what the data position refers to)
    and `report` (what each split holds, in lines for the run's start)."""

    def __new__(cls, train, validation, *, source: dict, report: str, allow_change: bool = False):
        blocks = super().__new__(cls, (train, validation))
        blocks.source, blocks.report, blocks.allow_change = source, report, allow_change
        return blocks

    def position(self, seed: int):
        """What holds the training data's position (its `state_dict()` goes into checkpoints, `resume` checks it):
        the seeded order of the map-style blocks (`BlockOrder`), or the stream itself (a `BlockStream`)."""
        if isinstance(self.train, Dataset):
            return BlockOrder(len(self.train), seed, self.source, self.allow_change)
        return self.train

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
    source = args.dataset_name or (
        shown_files(expand_files(args.train_files)) if args.train_files else "the built-in corpus"
    )
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
        files = expand_files(args.train_files)
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
            made_of(args, documents),
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
