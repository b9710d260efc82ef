"""A streaming source (issue 25, data at web scale): local JSON lines / Parquet / text shards read as a `datasets`
IterableDataset, split per process, tokenized and packed on the fly; its position resumes exactly (also across the
end of an epoch and after a SIGTERM); validation reads the same held-out blocks whatever the process count; a bad
field or an unreadable shard is one line naming it."""

import hashlib
import json
import os
import signal
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hf_p2r.errors import InputError
from hf_p2r.training import ConfigError, DataArguments, parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.data import BlockStream, byte_level_tokenizer, packing, stream_blocks

from .helpers import run_on_every_process, tiny_argv, trajectory

BLOCK = 32


def documents(shard: int, count: int) -> list[str]:
    """`count` documents of shard `shard`, each distinct, of uneven lengths (some shorter than a block)."""
    return [f"def f_{shard}_{i}(x):\n    return x * {i} + {shard}\n" * (1 + i % 4) for i in range(count)]


def jsonl_shards(folder, shards: int = 3, count: int = 30, name: str = "train") -> list[str]:
    paths = []
    for shard in range(shards):
        path = folder / f"{name}-{shard:05d}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(documents(shard, count)))
        )
        paths.append(str(path))
    return paths


def validation_shard(folder, column: str = "text") -> list[str]:
    path = folder / f"validation-{column}.jsonl"
    path.write_text("".join(json.dumps({column: f"class Held{i}:\n    out = {i}\n" * 3}) + "\n" for i in range(20)))
    return [str(path)]


def data_args(tmp_path, train_files, **fields) -> DataArguments:
    return DataArguments(
        streaming=True,
        train_files=train_files,
        validation_files=fields.pop("validation_files", None) or validation_shard(tmp_path),
        block_size=BLOCK,
        cache_dir=str(tmp_path / "cache"),
        **fields,
    )


def fingerprint(batch: torch.Tensor) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("shards", [3, 4])  # 2 processes: every other document (3 shards), or 2 whole shards each (4)
def test_a_stream_resumes_exactly_from_its_state_across_epochs_and_processes(tmp_path, shards):
    """Each process's stream, read in one go past the end of its first epoch, against the same stream stopped after
    k blocks, its state sent through JSON (as a checkpoint keeps it) into a fresh stream, and read on: the same blocks,
    for every k tried (inside the first packed batch, at the epoch's end, inside the second epoch)."""
    args = data_args(tmp_path, jsonl_shards(tmp_path, shards))
    tokenizer = byte_level_tokenizer()
    seen = {}
    for rank, size in [(0, 1), (0, 2), (1, 2)]:
        stream, _ = stream_blocks(args, tokenizer, rank, size, eval_blocks=4)
        first_epoch = len(list(stream.dataset))  # this process's blocks in one epoch
        total = 2 * first_epoch + 3
        reference = stream.take(total)
        assert reference.shape == (total, BLOCK) and reference.dtype == torch.long
        for k in (1, 5, first_epoch, first_epoch + 2):
            stopped, _ = stream_blocks(args, tokenizer, rank, size, eval_blocks=4)
            head = stopped.take(k)
            state = json.loads(json.dumps(stopped.state_dict()))
            resumed, _ = stream_blocks(args, tokenizer, rank, size, eval_blocks=4)
            resumed.load_state_dict(state)
            assert torch.equal(torch.cat([head, resumed.take(total - k)]), reference), (rank, size, k)
        seen[rank, size] = {fingerprint(block) for block in reference[:first_epoch]}
    assert not seen[0, 2] & seen[1, 2], "the two processes read different documents"
    tokens = {size: sum(len(seen[rank, size]) for rank in range(size)) for size in (1, 2)}
    assert tokens[2] >= tokens[1] - 2, "split by node, the processes read the whole stream between them"


def test_validation_is_the_same_blocks_whatever_the_process_count(tmp_path):
    args = data_args(tmp_path, jsonl_shards(tmp_path))
    tokenizer = byte_level_tokenizer()
    validations = [
        stream_blocks(args, tokenizer, rank, size, eval_blocks=6)[1] for rank, size in [(0, 1), (1, 2), (2, 3)]
    ]
    first = validations[0][:]["input_ids"]
    assert first.shape == (6, BLOCK)
    assert all(torch.equal(v[:]["input_ids"], first) for v in validations[1:])
    text = tokenizer.decode(first.flatten().tolist())
    assert text.startswith("class Held0:\n    out = 0\n") and "def f_" not in text  # the held-out files only


def test_parquet_and_text_shards_stream_their_documents(tmp_path):
    """A Parquet shard and one text file per document give the documents' bytes, each closed by <|endoftext|>."""
    texts = documents(7, 12)
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.eos_token_id
    expected = [t for text in texts for t in (*text.encode(), eos)]
    pq.write_table(pa.table({"content": texts}), tmp_path / "part-0.parquet")
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(text)
    for files, column in [([str(tmp_path / "part-0.parquet")], "content"), ([str(tmp_path / "docs")], "text")]:
        args = data_args(tmp_path, files, text_column=column, validation_files=validation_shard(tmp_path, column))
        stream, _ = stream_blocks(args, tokenizer, 0, 1, eval_blocks=2)
        count = len(expected) // BLOCK
        assert stream.take(count).flatten().tolist() == expected[: count * BLOCK], files


def test_the_state_of_two_processes_does_not_resume_one():
    stream = BlockStream(dataset=None, describe=str)
    with pytest.raises(
        InputError, match=r"^resume_from_checkpoint: ck holds the stream positions of 2 processes, this"
    ):
        stream.resume([{"epoch": 0}, {"epoch": 0}], 0, 1, "ck")


CONFIG_ERRORS = {
    "no source": (["--streaming", "true"], "streaming: give dataset_name or train_files to stream"),
    "no held-out files": (
        ["--streaming", "true", "--train_files", "a.jsonl"],
        "validation_files: a streaming run of train_files needs held-out files to evaluate on",
    ),
    "held-out files, not streaming": (
        ["--train_files", "a.jsonl", "--validation_files", "b.jsonl"],
        "validation_files: read by a streaming run only (streaming: true)",
    ),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_a_bad_streaming_field_is_one_line_naming_it(tmp_path, case):
    argv, message = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError) as raised:
        parse_config(tiny_argv(tmp_path / "run") + argv)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def _bad_json(folder) -> tuple[list[str], str]:
    files = jsonl_shards(folder, 2)
    with open(files[1], "a") as shard:
        shard.write('{"text": "half a record\n')
    return files, r"^train_files: \S*train-00001\.jsonl line 31 is not valid JSON \("


def _bad_parquet(folder) -> tuple[list[str], str]:
    (folder / "a.parquet").write_bytes(b"PAR1 not really")
    return [str(folder / "a.parquet")], r"^train_files: \S*a\.parquet is not a readable Parquet file \("


def _missing_column(folder) -> tuple[list[str], str]:
    return jsonl_shards(
        folder, 1
    ), r"^text_column: 'content' is not a column of \S*train-00000\.jsonl \(\['text', 'id'\]\)$"


def _blank(folder) -> tuple[list[str], str]:
    (folder / "blank.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    return [str(folder / "blank.jsonl")], r"^train_files: \S*blank\.jsonl holds no block of 32 tokens"


BAD_SHARDS = {
    "bad JSON line": _bad_json,
    "not Parquet": _bad_parquet,
    "missing column": _missing_column,
    "blank": _blank,
}


@pytest.mark.parametrize("case", BAD_SHARDS)
def test_an_unreadable_shard_is_one_line_naming_it_before_the_run_changes_anything(tmp_path, case):
    files, message = BAD_SHARDS[case](tmp_path)
    column = ["--text_column", "content"] if case == "missing column" else []
    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, pseudo_steps=1, real_steps=1, streaming="true")
    argv += ["--train_files", *files, "--validation_files", *validation_shard(tmp_path), *column]
    with pytest.raises(ValueError, match=message) as raised:  # (InputError is one)
        train(parse_config(argv))
    assert "\n" not in str(raised.value)
    assert not output_dir.exists()


# L=4, k=1, delinked at step 3; 8 steps of 4 blocks read 32 blocks, past the end of the corpus' first epoch (24).
SCHEDULE = dict(pseudo_steps=3, real_steps=5, eval_steps=2, save_steps=0, streaming="true")


@pytest.mark.parametrize("stop", [5, 7])  # in the first epoch (steps 1-6), in the second
def test_a_streaming_run_stopped_by_sigterm_resumes_on_the_batches_of_an_uninterrupted_run(tmp_path, monkeypatch, stop):
    """A real SIGTERM during step `stop` (its batch being read): the trainer's StopOnSignal finishes the step, saves
    the stream position with checkpoint-`stop` and exits 143; the resumed run reads exactly the batches the
    uninterrupted run read (fingerprints of every batch, across the epoch's end), and its losses are bitwise the
    same."""
    files = [*jsonl_shards(tmp_path, 2, count=5), "--validation_files", *validation_shard(tmp_path)]
    batches, stop_at = [], {"call": None}
    take = BlockStream.take

    def recording(self, count):
        batch = take(self, count)
        batches.append(fingerprint(batch))
        if len(batches) == stop_at["call"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    monkeypatch.setattr(BlockStream, "take", recording)

    def run(output_dir, **fields):
        return train(parse_config([*tiny_argv(output_dir, **SCHEDULE, **fields), "--train_files", *files]))

    assert run(tmp_path / "full") == 0
    uninterrupted, batches[:] = list(batches), []
    stop_at["call"] = stop
    assert run(tmp_path / "stopped") == 128 + signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path / "stopped")] == [f"checkpoint-{stop}"]
    assert batches == uninterrupted[:stop]
    stop_at["call"] = None
    assert run(tmp_path / "stopped", resume_from_checkpoint="latest") == 0
    assert len(uninterrupted) == 8 and batches == uninterrupted  # the stopped run's `stop` batches, then the rest
    assert trajectory(tmp_path / "stopped") == trajectory(tmp_path / "full")
    state = json.loads((tmp_path / "stopped/checkpoints/checkpoint-8/trainer_state.json").read_text())["state"]
    assert state["blocks_consumed"] == 32 and [s["epoch"] for s in state["stream_states"]] == [1]


def test_a_dataset_name_streams_its_train_split_and_evaluates_on_its_validation_split(tmp_path):
    """A dataset folder laid out as on the Hub (train and validation files: datasets' split names), named by
    dataset_name as a Hub name would be; without a validation split it is one line naming the field."""
    hub = tmp_path / "hub"
    hub.mkdir()
    jsonl_shards(hub, 2, name="train")
    validation = validation_shard(hub)[0]
    tokenizer = byte_level_tokenizer()
    args = DataArguments(streaming=True, dataset_name=str(hub), block_size=BLOCK, cache_dir=str(tmp_path / "cache"))
    stream, held_out = stream_blocks(args, tokenizer, 0, 1, eval_blocks=3)
    assert tokenizer.decode(stream.take(1)[0].tolist()).startswith("def f_0_0(x):")
    assert tokenizer.decode(held_out[:]["input_ids"][0].tolist()).startswith("class Held0:")
    os.rename(validation, tmp_path / "elsewhere.jsonl")
    with pytest.raises(
        InputError, match=rf"^dataset_name: {hub} has no validation split \(.*\): give validation_files"
    ):
        stream_blocks(args, tokenizer, 0, 1, eval_blocks=3)


LAYOUTS = {
    "data_parallel": dict(per_device_batch_size=2),
    "pipeline": dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", num_microbatches=2, shared_lr_scale="none"),
}


def streaming_fields(folder, layout: str) -> dict:
    """A streaming run of the shards in `folder` on two processes, a checkpoint every step."""
    files = sorted(str(path) for path in Path(folder).glob("train-*.jsonl"))
    fields = {**SCHEDULE, **LAYOUTS[layout], "save_steps": 1}
    return fields | {"train_files": files, "validation_files": [f"{folder}/validation-text.jsonl"]}


def streaming_run(folder: str, layout: str, rank: int, world_size: int) -> dict:
    """A streaming run of `layout` on two gloo processes, then resumed from its checkpoint-3: for each, its losses
    and the number of stream positions its last checkpoint holds."""
    results = []
    for checkpoint in (None, 3):
        run_on_every_process(folder, layout, streaming_fields(folder, layout), checkpoint)
        results.append(run_result(Path(folder) / layout))
    return {"full": results[0], "resumed": results[1]}


def run_result(output_dir: Path) -> dict:
    from hf_p2r.training.metrics import read_metrics

    state = json.loads((output_dir / "checkpoints/checkpoint-8/trainer_state.json").read_text())["state"]
    losses = [[r["step"], r["loss"]] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]
    return {"losses": losses, "positions": len(state["stream_states"])}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_split_the_stream_save_each_position_and_resume_exactly(tmp_path, layout):
    """Data-parallel (each process its half of the stream) and pipelined (both stages read one stream) streaming runs
    on two processes, resumed from checkpoint-3: bitwise the losses of the uninterrupted run, every checkpoint holding
    both processes' positions; the data-parallel checkpoint resumed on one process is refused in one line."""
    from ..distributed import spawn

    jsonl_shards(tmp_path, 2, count=5)
    validation_shard(tmp_path)
    results = spawn.run(partial(streaming_run, str(tmp_path), layout), 2, tmp_path)
    full, resumed = results["full"], results["resumed"]
    assert [step for step, _ in full["losses"]] == list(range(1, 9))
    assert resumed == full and full["positions"] == 2
    if layout == "data_parallel":
        checkpoint = tmp_path / layout / "checkpoints/checkpoint-3"
        argv = tiny_argv(tmp_path / layout, **streaming_fields(tmp_path, layout), resume_from_checkpoint=checkpoint)
        with pytest.raises(InputError, match=r"holds the stream positions of 2 processes, this run has 1: a streaming"):
            train(parse_config(argv))


def test_a_shard_that_breaks_mid_run_is_one_line_naming_it_and_keeps_the_checkpoints(tmp_path, monkeypatch):
    """The first shard fills the first packed batch (1,000 one-letter documents, one chunk: with one chunk per packed
    batch, 62 blocks, 15 steps of 4); the second shard, first read at step 16, has a bad line: the run stops there
    with one line naming that shard, and the checkpoints it saved before stay."""
    monkeypatch.setattr(packing, "PACK_CHUNKS", 1)
    first, second = tmp_path / "train-00000.jsonl", tmp_path / "train-00001.jsonl"
    first.write_text((json.dumps({"text": "x"}) + "\n") * 1000)
    second.write_text('{"text": "fine"}\n{"text": \n')
    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, pseudo_steps=10, real_steps=10, save_steps=5, eval_steps=0, streaming="true")
    argv += ["--train_files", str(first), str(second), "--validation_files", *validation_shard(tmp_path)]
    with pytest.raises(InputError, match=r"^train_files: \S*train-00001\.jsonl line 2 is not valid JSON \(") as raised:
        train(parse_config(argv))
    assert "\n" not in str(raised.value)
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-5", "checkpoint-10", "checkpoint-15"]


def test_a_stream_resumes_only_on_the_shards_it_saved_or_warns_with_allow_data_change(tmp_path):
    """The saved position names its shards (size, modification time): a shard changed since is refused in one line
    naming it; with allow_data_change the stream resumes from the position with a one-line warning."""
    shards = jsonl_shards(tmp_path, 2)
    args = data_args(tmp_path, shards)
    tokenizer = byte_level_tokenizer()
    blocks = stream_blocks(args, tokenizer, 0, 1, eval_blocks=2)
    assert blocks.report.splitlines() == [  # the run's first lines
        f"data: train streamed from train_files {shards[0]}, {shards[1]} (2 files), "
        f"{sum(map(os.path.getsize, shards)):,} bytes, split over 1 process(es) and tokenized as it is read (its "
        "documents and tokens are not counted ahead)",
        f"data: validation the first 2 blocks of 32 (64 tokens) of validation_files {args.validation_files[0]}",
    ]
    stream = blocks.train
    stream.take(3)
    states = json.loads(json.dumps([stream.state_dict()]))  # as a checkpoint keeps them
    assert states[0]["source"] == {"train_files": [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in shards]}
    same, _ = stream_blocks(args, tokenizer, 0, 1, eval_blocks=2)
    assert same.resume(states, 0, 1, tmp_path / "checkpoint-3") is None
    following = same.take(2)

    before = os.path.getsize(shards[1])
    with open(shards[1], "a") as shard:
        shard.write(json.dumps({"text": "one more document"}) + "\n")
    changed, _ = stream_blocks(args, tokenizer, 0, 1, eval_blocks=2)
    with pytest.raises(InputError) as refused:
        changed.resume(states, 0, 1, tmp_path / "checkpoint-3")
    assert str(refused.value) == (
        f"resume_from_checkpoint: the training data changed since {tmp_path / 'checkpoint-3'} was saved ({shards[1]}: "
        f"{before:,} bytes then, {os.path.getsize(shards[1]):,} now): the data position it holds would point into "
        "other data; restore the data, or pass --allow_data_change to resume on it"
    )
    allowed, _ = stream_blocks(data_args(tmp_path, shards, allow_data_change=True), tokenizer, 0, 1, eval_blocks=2)
    warning = allowed.resume(states, 0, 1, tmp_path / "checkpoint-3")
    assert warning.startswith("warning: the training data changed since ") and warning.endswith("resuming on it anyway")
    assert torch.equal(allowed.take(2), following), "the position is kept (the change is after it)"
    assert allowed.state_dict()["source"]["train_files"][1][1] == os.path.getsize(shards[1]), "the new data recorded"
