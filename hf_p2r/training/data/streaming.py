"""Streaming blocks: an `IterableDataset` split per process, tokenized and packed as it is read (`stream_blocks`), with
an exact position saved with every checkpoint (`BlockStream`)."""

from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from ...config import DataArguments
from ...errors import InputError
from .blocks import Blocks
from .documents import bad_files, expand_files, first_line, load_documents, quiet_datasets, shown_files
from .packing import tokenized_blocks
from .source import check_data_change, data_source


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
    source = args.dataset_name or shown_files(expand_files(args.train_files))
    field = "dataset_name" if args.dataset_name else "train_files"
    documents = split_dataset_by_node(load_documents(args), rank=data_rank, world_size=data_size)
    record = data_source(args)
    train = BlockStream(
        tokenized_blocks(documents, tokenizer, args), _describer(args, field, source), record, args.allow_data_change
    )
    train.check()
    held_out = "validation_files" if args.validation_files else "dataset_name"
    held_out_source = shown_files(expand_files(args.validation_files, held_out)) if args.validation_files else source
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
            with quiet_datasets():
                return bad_files(expand_files(paths, field), error, field)
        return f"{field}: could not read {source} ({first_line(error)})"

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
        with quiet_datasets():  # (once per call: setting the verbosity clears every logger's cache)
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
        with quiet_datasets():
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
