"""Resuming changes nothing under output_dir until the checkpoint has loaded (weights, optimizer, trainer state): a
damaged checkpoint, one that does not fit the run, or a schedule that ends before it is one line naming the file or
field (exit 2), and every earlier output stays as it was."""

import hashlib
import json
import os
import pickle
import shutil
import subprocess

import pytest
import torch

from hf_p2r.errors import InputError
from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints

from ..security.payload import CraftedPickle
from .helpers import PYTHON, REPO, run_trainer, subprocess_env, tiny_argv, trained_run, trajectory

# L=4, k=1: delinked to the real model at step 2; a checkpoint every step (1, 2 pseudo; 3, 4 real).
SCHEDULE = dict(pseudo_steps=2, real_steps=2, save_steps=1)


finished = trained_run("finished", **SCHEDULE)


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run to damage and resume."""
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    return output_dir


def snapshot(folder) -> dict:
    """Every file under `folder`: its content's hash and modification time (a rewrite with the same bytes shows)."""
    return {
        str(path.relative_to(folder)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def resume(output_dir, checkpoint: str, **overrides) -> int:
    # real_steps 3: another configuration than the run's, so an early rewrite of train_config.yaml would show.
    fields = {**SCHEDULE, "real_steps": 3, **overrides}
    return train(parse_config(tiny_argv(output_dir, **fields, resume_from_checkpoint=output_dir / checkpoint)))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def not_a_tensor_pickle(path):
    path.write_bytes(pickle.dumps({"state": {}, "param_groups": []}))


def a_foreign_object(path):
    torch.save({"state": {}, "param_groups": [], "hook": subprocess.Popen}, path)  # a class: refused by weights_only


def edit_state(change):
    def edit(path):
        payload = json.loads(path.read_text())
        change(payload)
        path.write_text(json.dumps(payload))

    return edit


DAMAGE = {
    "truncated model": (
        "model.safetensors",
        truncate,
        r"model\.safetensors: not a valid safetensors file: .*truncated",
    ),
    "truncated optimizer": ("optimizer.bin", truncate, r"optimizer\.bin: not a torch\.save file \(truncated"),
    "pickled optimizer": ("optimizer.bin", not_a_tensor_pickle, r"optimizer\.bin: not a torch\.save file"),
    "foreign object": ("optimizer.bin", a_foreign_object, r"optimizer\.bin: holds objects other than tensors"),
    "random states": ("random_states_0.pkl", truncate, r"random_states_0\.pkl: not a torch\.save file"),
    "malformed state": ("trainer_state.json", lambda p: p.write_text('{"state": '), r"trainer_state\.json: not valid"),
    "missing key": ("trainer_state.json", edit_state(lambda d: d["state"].pop("step")), r'"state\.step" missing'),
    "extra key": ("trainer_state.json", edit_state(lambda d: d.update(x=1)), r'json: unexpected "x"'),
    "mistyped key": (
        "trainer_state.json",
        edit_state(lambda d: d["state"].update(num_blocks="4")),
        r'trainer_state\.json: "state\.num_blocks" is "4", expected an integer >= 1',
    ),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_its_file_and_changes_nothing(run, case):
    error = _refused(run, *DAMAGE[case])
    assert str(run / "checkpoints/checkpoint-3") in error


def _refused(run, name: str, damage, message: str, **overrides) -> str:
    """A resume from checkpoint-3 of `run`, its file `name` damaged by `damage`, fails with one line matching
    `message`, changing nothing in the run's folder: that line."""
    damage(run / "checkpoints/checkpoint-3" / name)
    before = snapshot(run)
    with pytest.raises(InputError, match=message) as raised:
        resume(run, "checkpoints/checkpoint-3", **overrides)
    assert "\n" not in str(raised.value)
    assert snapshot(run) == before
    return str(raised.value)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_a_checkpoint_that_does_not_fit_is_refused_after_loading_and_changes_nothing(run, name):
    """Whole files from another checkpoint (one block before the delink, four after): only the load finds out. The
    newer checkpoints, the metrics after step 3 and train_config.yaml are still there, untouched."""
    shutil.copy(run / "checkpoints/checkpoint-1" / name, run / "checkpoints/checkpoint-3" / name)
    before = snapshot(run)
    with pytest.raises(InputError, match=r"^resume_from_checkpoint: .*checkpoint-3 does not fit this run \("):
        resume(run, "checkpoints/checkpoint-3")
    assert snapshot(run) == before
    assert [p.name for p in list_checkpoints(run)] == [f"checkpoint-{step}" for step in (1, 2, 3, 4)]


def test_resuming_changes_the_folder_only_after_the_load(run, finished, monkeypatch):
    """The load sees every newer checkpoint and metrics record still in place; then the resume drops them and trains
    on exactly as the first run did."""
    from accelerate import Accelerator

    seen = {}
    load_state = Accelerator.load_state

    def watching(self, folder, *args, **kwargs):
        seen["checkpoints"] = [p.name for p in list_checkpoints(run)]
        seen["metrics"] = (run / "metrics.jsonl").read_text()
        return load_state(self, folder, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "load_state", watching)
    metrics = (run / "metrics.jsonl").read_text()
    assert resume(run, "checkpoints/checkpoint-1", real_steps=2) == 0
    assert seen == {"checkpoints": [f"checkpoint-{step}" for step in (1, 2, 3, 4)], "metrics": metrics}
    assert trajectory(run) == trajectory(finished)


@pytest.mark.parametrize(
    ("checkpoint", "overrides", "total"),
    [("checkpoint-4", dict(real_steps=1), 3), ("checkpoint-4", dict(pseudo_steps=1, real_steps=2), 3)],
)
def test_a_schedule_that_ends_before_the_checkpoint_is_refused(run, checkpoint, overrides, total):
    """The loop stopped only at total_steps exactly: resuming past it trained for ever. It is refused at once."""
    before = snapshot(run)
    with pytest.raises(
        InputError, match=rf"checkpoint-4 is at step 4, past the end of this schedule .*= {total} steps"
    ):
        resume(run, f"checkpoints/{checkpoint}", **overrides)
    assert snapshot(run) == before


def test_resuming_a_finished_run_at_its_last_step_ends_at_once(run):
    assert resume(run, "checkpoints/checkpoint-4", real_steps=2) == 0
    assert [p.name for p in list_checkpoints(run)][-1] == "checkpoint-4"


def test_a_checkpoint_of_another_block_count_is_refused(run):
    state = run / "checkpoints/checkpoint-3/trainer_state.json"
    edit_state(lambda d: d["state"].update(num_blocks=3))(state)
    with pytest.raises(InputError, match=r'trainer_state\.json: stage "real" does not match num_blocks 3 of 4 layers'):
        resume(run, "checkpoints/checkpoint-3")
    edit_state(lambda d: d.update(stage="pseudo"))(state)
    with pytest.raises(InputError, match=r"checkpoint-3 holds a model with 3 blocks at step 3, but this configuration"):
        resume(run, "checkpoints/checkpoint-3")


@pytest.mark.parametrize("case", ["truncated optimizer", "missing key"])
def test_the_script_says_one_line_and_exits_2_for_a_damaged_checkpoint(run, case):
    """As users run it: no traceback, within the timeout (a hang fails it)."""
    name, damage, message = DAMAGE[case]
    damage(run / "checkpoints/checkpoint-3" / name)
    before = snapshot(run)
    argv = tiny_argv(run, **SCHEDULE, resume_from_checkpoint=run / "checkpoints/checkpoint-3")
    result = run_trainer(argv, [PYTHON, str(REPO / "scripts/train.py")])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("train.py: error: ") and "checkpoint-3" in errors[0], errors
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(run) == before


# Issue 36: a checkpoint names only its own files. Refused before anything loads or changes, in one line.
def _link_to_checkpoint_4(name):
    def link(path):
        path.unlink()
        path.symlink_to(f"../checkpoint-4/{name}")

    return link


def _crafted_engine_folder(path):
    """An engine's DCP folder (Accelerate's FSDP state: `pytorch_model_fsdp_0/`) whose `.metadata` runs code when
    torch's own reader unpickles it."""
    folder = path.parent / "pytorch_model_fsdp_0"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(CraftedPickle(path.parent / "ran")))


NOT_ITS_OWN = {
    "weights linked to another checkpoint": (
        "model.safetensors",
        _link_to_checkpoint_4("model.safetensors"),
        r"checkpoint-3/model\.safetensors: refused: a link out of .*checkpoint-3 \(to .*checkpoint-4/model",
    ),
    "optimizer linked out": (
        "optimizer.bin",
        _link_to_checkpoint_4("optimizer.bin"),
        r"checkpoint-3/optimizer\.bin: refused: a link out of",
    ),
    "trainer state linked out": (
        "trainer_state.json",
        _link_to_checkpoint_4("trainer_state.json"),
        r"checkpoint-3/trainer_state\.json: refused: a link out of",
    ),
    "a FIFO": ("extra", lambda path: os.mkfifo(path), r"checkpoint-3/extra: refused: a FIFO"),
    "an engine folder's crafted pickle": (
        "ignored",
        _crafted_engine_folder,
        r"pytorch_model_fsdp_0/\.metadata: damaged \(UnpicklingError: posix\.system is not part of",
    ),
}


@pytest.mark.parametrize("case", NOT_ITS_OWN)
def test_a_checkpoint_naming_files_not_its_own_is_refused_before_anything_changes(run, case):
    _refused(run, *NOT_ITS_OWN[case], save_total_limit=1)
    assert not (run / "checkpoints/checkpoint-3/ran").exists()


# Issue 36: a resume with another optimizer said "missing key optimizer.model...step"; it names the field.
OPTIMIZER_MESSAGE = (
    r"comes from a different run \(optimizer='{saved}' there, '{now}' now\); an optimizer's state does not load "
    r"into another's: resume with --optimizer {saved}, or start a new run$"
)


def test_a_resume_with_another_optimizer_names_the_field(run):
    before = snapshot(run)
    with pytest.raises(InputError, match=OPTIMIZER_MESSAGE.format(saved="adamw", now="muon")):
        resume(run, "checkpoints/checkpoint-3", optimizer="muon")
    assert snapshot(run) == before


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize(("saved", "now"), [("adamw", "muon"), ("muon", "adamw")])
def test_the_optimizer_is_checked_whichever_model_and_direction(tmp_path, moe, saved, now):
    """read_state alone (what every engine runs first): MoE and dense, adamw <-> muon; a checkpoint older than the
    field (no "optimizer" recorded) is AdamW's, the only optimizer then."""
    from hf_p2r.training.checkpointing import STATE_FILE, TrainState, read_state

    extra = dict(num_experts=4, moe_intermediate_size=32) if moe else {}
    config = lambda optimizer: parse_config(tiny_argv(tmp_path / "out", **extra, optimizer=optimizer))  # noqa: E731
    recorded = config(saved).to_dict()
    (tmp_path / STATE_FILE).write_text(json.dumps({"state": vars(TrainState()), "config": recorded}))
    assert read_state(tmp_path, config(saved)) == TrainState()
    with pytest.raises(InputError, match=OPTIMIZER_MESSAGE.format(saved=saved, now=now)):
        read_state(tmp_path, config(now))
    if saved == "adamw":
        del recorded["optimizer"]
        (tmp_path / STATE_FILE).write_text(json.dumps({"state": vars(TrainState()), "config": recorded}))
        assert read_state(tmp_path, config("adamw")) == TrainState()
        with pytest.raises(InputError, match=OPTIMIZER_MESSAGE.format(saved="adamw", now="muon")):
            read_state(tmp_path, config("muon"))


@pytest.mark.parametrize("inside", ["", "out"], ids=["the checkpoint", "inside it"])
def test_an_output_dir_in_the_checkpoint_it_resumes_from_is_refused(run, inside):
    """The run's outputs (checkpoints, metrics, models) would be written into the checkpoint it reads."""
    checkpoint = run / "checkpoints/checkpoint-3"
    before = snapshot(run)
    argv = tiny_argv(checkpoint / inside, **SCHEDULE, resume_from_checkpoint=checkpoint)
    with pytest.raises(InputError, match=r"is the checkpoint it resumes from \(.*checkpoint-3\) or lies inside it"):
        train(parse_config(argv))
    assert snapshot(run) == before


def test_another_optimizer_is_one_line_and_exit_2_as_users_run_it(run):
    """In a fresh process, with a timeout: the field named, no traceback, nothing changed."""
    before = snapshot(run)
    argv = tiny_argv(run, **SCHEDULE, optimizer="muon", resume_from_checkpoint=run / "checkpoints/checkpoint-3")
    result = subprocess.run(
        [PYTHON, str(REPO / "scripts/train.py"), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "(optimizer='adamw' there, 'muon' now)" in errors[0], errors
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(run) == before
