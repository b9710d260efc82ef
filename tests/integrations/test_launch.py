"""P2RTrainer under `accelerate launch`: two gloo CPU processes (DDP, wrapped again at each delink) against one process
at the same global batch, and a resume of the two-process run from a checkpoint of its real stage; the same for a run
that grows in depth. Both two-process runs share one launch, and both resumes a second."""

import json
import os
import signal
import socket
import subprocess

import pytest

from hf_p2r.integrations import P2RCallback

from ..training.helpers import ACCELERATE, REPO, subprocess_env
from .helpers import deterministic, history, p2r_config, trainer_for

# 1 -> 2 blocks at step 2, real at 4, 7 steps; gradient accumulation (DDP skips the all-reduce of the first micro-batch
# of each step: after a delink through the current wrapper, P2RTrainer.training_step), a checkpoint every 2 steps.
FIELDS = dict(pseudo_steps=4, real_steps=3, partial_delink_blocks=[2], partial_delink_steps=[2])
FIELDS |= dict(gradient_accumulation_steps=2, per_device_batch_size=4)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    tmp_path,
    name: str,
    processes: int,
    resume=None,
    fields=None,
    args=None,
    launcher=(),
    timeout: int = 900,
    growth: dict | None = None,
) -> list[dict]:
    """One run of `tests.integrations.helpers` under `accelerate launch` (`launcher`: its extra flags) with
    `processes` CPU processes, each taking an equal slice of the same global batch; its log history. `growth`:
    {"callback": P2RCallback's arguments, "real_depth": ...} for a run that grows."""
    run = dict(resume=resume, fields=fields, args=args, growth=growth)
    return launch_runs(tmp_path, {name: run}, processes, launcher=launcher, timeout=timeout)[name]


def launch_runs(tmp_path, runs: dict[str, dict], processes: int, launcher=(), timeout: int = 900) -> dict:
    """Several runs (name: `launch`'s resume, fields, args and growth) one after the other in the processes of one
    `accelerate launch` (the launcher's and the processes' start-up cost more than a tiny run); {name: log history}."""
    specs = []
    for name, run in runs.items():
        fields = {**FIELDS, **(run.get("fields") or {})}
        specs.append(
            {
                "output_dir": str(tmp_path / name),
                "fields": {**fields, "per_device_batch_size": fields["per_device_batch_size"] // processes},
                "args": {"save_strategy": "steps", "save_steps": 2, **(run.get("args") or {})},
                "world_size": processes,
                "resume": run.get("resume"),
                **(run.get("growth") or {}),
            }
        )
    spec_file = tmp_path / f"{'+'.join(runs)}.json"
    spec_file.write_text(json.dumps(specs))
    command = [ACCELERATE, "launch", *launcher, "--num_processes", str(processes)]
    command += ["--main_process_port", str(free_port())] + (["--multi_gpu"] if processes > 1 else [])
    command += ["-m", "tests.integrations.helpers", str(spec_file)]
    # Its own process group: a run past its time is ended with the processes the launcher started.
    process = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, stderr[-3000:]
    return {name: history(tmp_path / name) for name in runs}


# A 2-layer model sharing 1 block (real depth 4) grown to 4 layers with 2 blocks at step 2, delinked at 4.
GROWTH_FIELDS = dict(num_hidden_layers=2, pseudo_steps=6, real_steps=0, partial_delink_blocks=[],
                     partial_delink_steps=[], gradient_accumulation_steps=2, per_device_batch_size=4)  # fmt: skip
GROWTH = {"callback": {"growth": [[2, 4, 2]], "delink_at": [[4, None]]}, "real_depth": 4}
CHECKPOINTS = {"two": "checkpoint-6", "grow": "checkpoint-4"}  # the real stage's, the grown stage's


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple:
    """Both tests' two-process runs in one launch, then their resumes in a second (fresh processes, as a user resumes):
    (the folder, {name: log history})."""
    folder = tmp_path_factory.mktemp("launch")
    runs = launch_runs(folder, {"two": {}, "grow": {"fields": GROWTH_FIELDS, "growth": GROWTH}}, processes=2)
    resumes = {
        "two-resumed": {"resume": str(folder / "two" / CHECKPOINTS["two"])},
        "grow-resumed": {"resume": str(folder / "grow" / CHECKPOINTS["grow"]), "fields": GROWTH_FIELDS,
                         "growth": GROWTH},
    }  # fmt: skip
    return folder, runs | launch_runs(folder, resumes, processes=2)


@pytest.mark.slow
def test_two_processes_match_one_and_resume_from_the_real_stage_bitwise(tmp_path, launched):
    """Same data and updates: the two runs differ only in the order of float sums (DDP averages two processes'
    gradients), within 1e-5 relative like hf-p2r's own trainer's test (tests/training/test_launch.py), far below what
    a step changes (~1e-2): a lost all-reduce after a delink (the new blocks' gradients) would fail it."""
    one = trainer_for(p2r_config(tmp_path / "one", **FIELDS))
    one.train()
    folder, runs = launched
    single, double = deterministic(one.state.log_history), deterministic(runs["two"])
    assert [sorted(r) for r in single] == [sorted(r) for r in double]
    assert [r["p2r/num_blocks"] for r in double if "loss" in r] == [1, 1, 2, 2, 4, 4, 4]
    for a, b in zip(single, double):
        for key in ("loss", "grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    checkpoint = folder / "two" / CHECKPOINTS["two"]
    assert json.loads((checkpoint / "config.json").read_text())["share_layers"] is False  # the real model
    assert deterministic(runs["two-resumed"]) == double  # built pseudo, delinked, loaded


@pytest.mark.slow
def test_two_processes_grow_like_one_and_resume_from_the_grown_stage_bitwise(tmp_path, launched):
    """A 2-layer model sharing 1 block (real depth 4) grown to 4 layers with 2 blocks at step 2 (DDP wrapped again
    around the grown model), delinked at 4: the two-process run matches one process within 1e-5 relative as above,
    and resumes bitwise from its grown checkpoint-4 (the script's 2-layer model grown again to that stage)."""
    config = p2r_config(tmp_path / "one", **GROWTH_FIELDS)
    one = trainer_for(config, callback=P2RCallback(**GROWTH["callback"]), real_depth=4)
    one.train()
    folder, runs = launched
    single, double = deterministic(one.state.log_history), deterministic(runs["grow"])
    assert [sorted(r) for r in single] == [sorted(r) for r in double]
    stages = [(r["p2r/num_hidden_layers"], r["p2r/num_blocks"]) for r in double if "loss" in r]
    assert stages == [(2, 1), (2, 1), (4, 2), (4, 2), (4, 4), (4, 4)]
    for a, b in zip(single, double):
        for key in ("loss", "grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    checkpoint = folder / "grow" / CHECKPOINTS["grow"]
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_unique_layers"]) == (4, 2)
    assert deterministic(runs["grow-resumed"]) == double
