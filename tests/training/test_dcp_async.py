"""Asynchronous DCP checkpoints (`checkpoint_async`, `hf_p2r.training.checkpointing.save_checkpoint`): the state is
copied to CPU memory, training goes on while a background thread writes the shards, and the checkpoint is renamed into
place when the write completes. What is saved is what a synchronous save writes (bitwise), a checkpoint is never seen
partial, a failed write keeps the checkpoints already there, and `save_total_limit` prunes only complete ones."""

import errno
import functools
import importlib
import json
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import TrainState, finish_checkpoint, list_checkpoints, save_checkpoint
from hf_p2r.training.config import ConfigError
from hf_p2r.training.dcp import load_model_state, model_state
from hf_p2r.training.dcp import save as save_dcp

from ..distributed import spawn
from .helpers import run_on_every_process, tiny_argv, trajectory
from .test_dcp import PIPELINE, SCHEDULE, copy_run, resume

ASYNC = dict(checkpoint_async="true")
train_module = importlib.import_module("hf_p2r.training.train")  # (the package exports its function `train`)


def saved_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of DCP checkpoint `checkpoint`, by its flattened name (read through torch's own converter)."""
    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(checkpoint, scratch)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(scratch, weights_only=True))
    return flat


def assert_same_checkpoints(one: Path, other: Path, scratch: Path) -> None:
    names = [path.name for path in list_checkpoints(one)]
    assert names == [path.name for path in list_checkpoints(other)] and names
    for name in names:
        got = saved_tensors(one / "checkpoints" / name, scratch / f"{name}-a.pt")
        want = saved_tensors(other / "checkpoints" / name, scratch / f"{name}-b.pt")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key], want[key]) for key in want), name
        a, b = (json.loads((run / "checkpoints" / name / "trainer_state.json").read_text()) for run in (one, other))
        for saved in (a, b):  # (what differs: the wall time, the folder, the option itself)
            del saved["state"]["train_time_s"], saved["config"]["output_dir"], saved["config"]["checkpoint_async"]
        assert a == b


# --- one process ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run (L=4, k=1, delinked at step 2, a checkpoint every step) saved synchronously and asynchronously."""
    folder = tmp_path_factory.mktemp("dcp_async")
    assert train(parse_config(tiny_argv(folder / "sync", **SCHEDULE))) == 0
    assert train(parse_config(tiny_argv(folder / "async", **SCHEDULE, **ASYNC))) == 0
    return folder


def test_an_async_run_saves_what_a_synchronous_one_saves(runs):
    """The same losses, the same checkpoints (every tensor bitwise, the same trainer state), each renamed into place
    (no temporary folder left)."""
    assert trajectory(runs / "async") == trajectory(runs / "sync")
    assert_same_checkpoints(runs / "async", runs / "sync", runs / "scratch")
    assert sorted(p.name for p in (runs / "async/checkpoints").iterdir()) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("checkpoint", [1, 3])
def test_an_async_checkpoint_resumes_bitwise(runs, tmp_path, checkpoint):
    """Before the delink (pseudo, 1 block) and after (real, 4 blocks): every logged value as the uninterrupted run."""
    run = copy_run(runs / "async", tmp_path / "run")
    assert resume(run, checkpoint, **ASYNC) == 0
    assert trajectory(run) == trajectory(runs / "sync")


def test_async_is_refused_without_dcp(tmp_path):
    with pytest.raises(ConfigError, match=r"^checkpoint_async: asynchronous saves write DCP checkpoints") as raised:
        parse_config(tiny_argv(tmp_path / "run", **ASYNC, checkpoint_format="accelerate"))
    assert "\n" not in str(raised.value)


class Gate:
    """`write_data`: `FileSystemWriter.write_data` (run by DCP's background thread) waiting until `open` is set."""

    def __init__(self):
        self.open, self.waiting = threading.Event(), threading.Event()
        original = FileSystemWriter.write_data

        def write_data(writer, *args, **kwargs):
            self.waiting.set()
            if not self.open.wait(timeout=120):
                raise TimeoutError("the test never opened the gate")
            return original(writer, *args, **kwargs)

        self.write_data = write_data


def _linear_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    state = model_state(model, optimizer)
    return {
        **{f"model.{k}": v.clone() for k, v in state["model"].items()},
        **{f"optimizer.{k}.{n}": v.clone() for k, s in state["optimizer"].items() for n, v in s.items()},
    }


def test_a_checkpoint_appears_only_complete_and_holds_the_state_of_its_step(tmp_path, monkeypatch):
    """The write of checkpoint 2 held back: the save returns, the checkpoint is only its temporary folder (not listed,
    checkpoint 1 not pruned although save_total_limit is 1), and the weights and optimizer state the training then
    changes in place do not reach it; once the write completes it is renamed into place, then checkpoint 1 pruned."""
    config = parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, **ASYNC, save_total_limit=1))
    accelerator, (model, optimizer) = Accelerator(cpu=True), _linear_and_adamw()

    def write(folder: Path) -> None:
        save_dcp(folder, model_state(model, optimizer))

    checkpoints = tmp_path / "run/checkpoints"
    save_checkpoint(accelerator, tmp_path / "run", TrainState(step=1), config, write=write)
    finish_checkpoint(accelerator)
    assert [p.name for p in checkpoints.iterdir()] == ["checkpoint-1"]

    gate = Gate()
    monkeypatch.setattr(FileSystemWriter, "write_data", gate.write_data)
    expected = _snapshot(model, optimizer)
    save_checkpoint(accelerator, tmp_path / "run", TrainState(step=2), config, write=write)
    assert gate.waiting.wait(timeout=120)
    [temporary] = [p.name for p in checkpoints.iterdir() if p.name != "checkpoint-1"]
    assert temporary.startswith(".checkpoint-2.tmp-")
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-1"]
    model(torch.ones(2, 8)).sum().backward()  # the training goes on: a step changes weights and optimizer state
    optimizer.step()
    assert not torch.equal(model.weight, expected["model.weight"])
    gate.open.set()
    finish_checkpoint(accelerator)
    assert [p.name for p in checkpoints.iterdir()] == ["checkpoint-2"]

    fresh, fresh_optimizer = _linear_and_adamw()
    load_model_state(checkpoints / "checkpoint-2", fresh, fresh_optimizer)
    loaded = _snapshot(fresh, fresh_optimizer)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_save_that_fails_after_its_write_began_waits_for_it(tmp_path, monkeypatch):
    """The trainer state fails to be written (a full disk) once the shards' background write has begun: that write
    ends before the temporary folder is removed and the error raised."""
    from types import SimpleNamespace

    from hf_p2r.training import checkpointing

    config = parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, **ASYNC))
    accelerator, (model, optimizer) = Accelerator(cpu=True), _linear_and_adamw()
    write_data, ended = FileSystemWriter.write_data, threading.Event()

    def slow(self, *args, **kwargs):
        threading.Event().wait(0.5)
        try:
            return write_data(self, *args, **kwargs)
        finally:
            ended.set()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "trainer_state.json")

    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    monkeypatch.setattr(checkpointing, "json", SimpleNamespace(dumps=full))
    with pytest.raises(OSError, match=r"^checkpoint-1 not saved: no space left on device \(ENOSPC\) writing trainer"):
        save_checkpoint(
            accelerator,
            tmp_path / "run",
            TrainState(step=1),
            config,
            write=lambda f: save_dcp(f, model_state(model, optimizer)),
        )
    assert ended.is_set()
    assert not list((tmp_path / "run").rglob("*checkpoint-1*"))  # (its temporary folder removed)
    finish_checkpoint(accelerator)  # nothing left pending


def test_a_failed_async_write_keeps_the_checkpoints_already_there(tmp_path, monkeypatch):
    """The background write of checkpoint 2 fails (the disk full): the next save finds out and stops the run with the
    save protocol's one line; the temporary folder is gone and checkpoint 1 kept (save_total_limit 1 pruned nothing)."""
    write_data, calls = FileSystemWriter.write_data, []

    def full_at_the_second(self, *args, **kwargs):
        calls.append(threading.current_thread() is threading.main_thread())
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", "__0_0.distcp")
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_at_the_second)
    with pytest.raises(
        OSError, match=r"^checkpoint-2 not saved: no space left on device \(ENOSPC\) writing __0_0"
    ) as e:
        train(parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, **ASYNC, eval_steps=0, save_total_limit=1)))
    assert "\n" not in str(e.value)
    assert calls == [False, False]  # written in the background thread; the run stopped at the next save
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["checkpoint-1"]


def test_a_run_that_fails_waits_for_its_background_write(tmp_path, monkeypatch):
    """An error in step 2 while checkpoint 1 is still being written (slowly): the run's own error comes out, after the
    write ended and its checkpoint was renamed into place (before the process group goes, nothing left half-done)."""
    write_data = FileSystemWriter.write_data

    def slow(self, *args, **kwargs):
        threading.Event().wait(1.0)
        return write_data(self, *args, **kwargs)

    batches, next_batch = [], train_module.next_batch

    def failing_at_step_2(*args):
        batches.append(1)
        if len(batches) == 2:
            raise RuntimeError("a failure in step 2")
        return next_batch(*args)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    monkeypatch.setattr(train_module, "next_batch", failing_at_step_2)
    with pytest.raises(RuntimeError, match="^a failure in step 2$"):
        train(parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, **ASYNC, eval_steps=0)))
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["checkpoint-1"]


def test_a_signal_stops_the_run_after_its_checkpoint_is_written(tmp_path, monkeypatch, capsys):
    """SIGTERM in step 2: the run saves checkpoint 2 and waits for its background write before it says "checkpoint
    saved" and returns 143; a write that fails there stops the run with the save's one line instead."""
    write_data, writes = FileSystemWriter.write_data, []

    def third_fails(self, *args, **kwargs):
        writes.append(1)
        threading.Event().wait(0.5)  # slow: the wait for it shows
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", "__0_0.distcp")
        return write_data(self, *args, **kwargs)

    batches, next_batch = [], train_module.next_batch

    def signal_in_step_2(*args):
        batches.append(1)
        if len(batches) in (2, 3):  # step 2 of each run: the first run, then the one resumed from checkpoint 1
            signal.raise_signal(signal.SIGTERM)
        return next_batch(*args)

    monkeypatch.setattr(FileSystemWriter, "write_data", third_fails)
    monkeypatch.setattr(train_module, "next_batch", signal_in_step_2)
    run = tmp_path / "run"
    assert train(parse_config(tiny_argv(run, **SCHEDULE, **ASYNC, eval_steps=0))) == 143
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert "checkpoint saved: resume with --resume_from_checkpoint latest" in capsys.readouterr().out
    shutil.rmtree(run / "checkpoints/checkpoint-2")
    with pytest.raises(OSError, match=r"^checkpoint-2 not saved: no space left on device \(ENOSPC\)"):
        resume(run, 1, **ASYNC, eval_steps=0)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1"]
    assert "checkpoint saved" not in capsys.readouterr().out


# --- two processes (gloo) ---------------------------------------------------------------------------------------------
def _pipelines(folder: str, rank: int, world: int) -> dict:
    """Two pipeline stages (1F1B, delinked at step 2), saved synchronously and asynchronously; the async run resumed
    from its checkpoint 3 (after the delink) with async saves."""
    async_pipeline = {**PIPELINE, **ASYNC}
    return {
        "sync": run_on_every_process(folder, "sync", PIPELINE),
        "async": run_on_every_process(folder, "async", async_pipeline),
        "async from 3": run_on_every_process(folder, "async from 3", async_pipeline, 3, "async"),
    }


def test_two_processes_save_asynchronously_what_they_save_synchronously(tmp_path):
    out = spawn.run(functools.partial(_pipelines, str(tmp_path)), 2, tmp_path)
    assert out["async"] == out["sync"]
    assert out["async from 3"] == out["sync"]
    assert_same_checkpoints(tmp_path / "async", tmp_path / "sync", tmp_path / "scratch")
    assert (tmp_path / "async/checkpoints/checkpoint-3/__1_0.distcp").is_file()  # each process wrote its shards


def _held_back_on_one_process(folder: str, rank: int, world: int) -> dict:
    """Process 1's write of checkpoint 2 held back while both processes run collectives of their own on the default
    group (what training does meanwhile): the checkpoint is not in place on process 0 until process 1's write is."""
    run = Path(folder) / "run"
    config = parse_config(tiny_argv(run, **SCHEDULE, **ASYNC, save_total_limit=1))
    accelerator, (model, optimizer) = Accelerator(cpu=True), _linear_and_adamw()

    def write(path: Path) -> None:
        save_dcp(path, model_state(model, optimizer))

    save_checkpoint(accelerator, run, TrainState(step=1), config, write=write)
    finish_checkpoint(accelerator)
    gate = Gate()
    if rank == 1:
        FileSystemWriter.write_data = gate.write_data  # (a spawned process of its own: nothing to restore)
    else:
        gate.open.set()
    save_checkpoint(accelerator, run, TrainState(step=2), config, write=write)
    sums = []
    for _ in range(20):
        value = torch.ones(1)
        dist.all_reduce(value)
        sums.append(value.item())
    seen = [p.name for p in list_checkpoints(run)]
    dist.barrier()
    gate.open.set()
    finish_checkpoint(accelerator)
    return {"sums": sums, "while held back": seen, "after": sorted(p.name for p in (run / "checkpoints").iterdir())}


def test_a_checkpoint_waits_for_every_process_write(tmp_path):
    out = spawn.run(functools.partial(_held_back_on_one_process, str(tmp_path)), 2, tmp_path)
    assert out["sums"] == [2.0] * 20
    assert out["while held back"] == ["checkpoint-1"]
    assert out["after"] == ["checkpoint-2"]


def _fsdp2(folder: str, rank: int, world: int) -> dict:
    """FSDP2 over two processes: the same state saved synchronously, then asynchronously, its write held back while a
    training step runs (its own collectives; the weights and optimizer state changed in place)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_p2r.training.dcp import background_writes
    from hf_p2r.training.dcp import wait as wait_for_write

    from .test_dcp import BATCH, _model_and_optimizer, _steps

    ids = BATCH.chunk(world)[rank]
    model, optimizer = _model_and_optimizer(init_device_mesh("cpu", (world,)))
    _steps(model, optimizer, ids, 2)
    save_dcp(Path(folder) / "sync", model_state(model, optimizer))
    gate = Gate()
    FileSystemWriter.write_data = gate.write_data  # (a spawned process of its own: nothing to restore)
    with background_writes() as futures:
        save_dcp(Path(folder) / "async", model_state(model, optimizer))
    _steps(model, optimizer, ids, 1)  # before the write (held back until then) begins
    gate.open.set()
    [future] = futures
    wait_for_write(future)
    return {}


def test_fsdp2_shards_are_saved_asynchronously_as_synchronously(tmp_path):
    """DTensor shards copied to CPU memory by torch's stager: the checkpoint holds the state of the save's step."""
    spawn.run(functools.partial(_fsdp2, str(tmp_path)), 2, tmp_path)
    got = saved_tensors(tmp_path / "async", tmp_path / "scratch/a.pt")
    want = saved_tensors(tmp_path / "sync", tmp_path / "scratch/b.pt")
    assert got.keys() == want.keys() and "model.model.layers.0.mlp.up_proj.weight" in want
    assert all(torch.equal(got[key], want[key]) for key in want)
