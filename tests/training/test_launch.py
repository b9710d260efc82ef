"""The training script as users run it: through `accelerate launch`, on one and on two CPU processes, and stopped
by SIGTERM / SIGINT, sent to the trainer or to its launcher."""

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.metrics import read_metrics

from ..distributed import spawn
from .helpers import ACCELERATE, PYTHON, REPO, demo_launch, subprocess_env, tiny_argv, trajectory
from .uneven_eval_worker import uneven_evaluation

TRAIN_SCRIPT = str(REPO / "scripts/train.py")
# How long a test waits for a run to get somewhere (start, reach a step, stop after a signal) before failing. Only a
# hung run waits this long: each wait ends as soon as what it waits for happens, and on a loaded two-core machine
# the start alone (imports, tokenising) can take minutes.
PATIENCE = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    environment = {**subprocess_env(), **env}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO, timeout=timeout)
    errors = [line for line in result.stderr.splitlines() if "train.py: error" in line]
    assert result.returncode == 0, "\n".join(errors) + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_make_demo_trains_through_accelerate_launch_without_the_launchers_notice_of_defaults(tmp_path):
    """The README's command (`make demo`'s command line) with the demo configuration, shrunk to a few steps of a tiny
    model (its growth too). Its launcher flags give `accelerate launch` every value it would otherwise default and
    list in a four-line notice (which `-q` does not silence): it prints none."""
    output_dir = tmp_path / "demo"
    overrides = tiny_argv(
        output_dir,
        pseudo_steps=3,
        real_steps=2,
        eval_steps=2,
        corpus_max_bytes=20000,
        partial_delink_steps=[1],
        partial_delink_blocks=[2],
    )
    launch = demo_launch()
    assert launch[0] == "accelerate" and launch[-2:] == ["--config", "configs/demo.yaml"]
    # HF_HOME: no `accelerate config` file to read the launcher's values from
    result = _run([ACCELERATE, *launch[1:], *overrides], HF_HOME=str(tmp_path / "hf"))
    assert "not passed to `accelerate launch`" not in result.stdout + result.stderr, result.stderr
    records = read_metrics(output_dir / "metrics.jsonl")
    assert [(r["step"], r["num_blocks"]) for r in records if r.get("event") == "delink"] == [(1, 2), (3, 4)]
    assert [r["stage"] for r in records if "loss" in r] == ["pseudo"] * 3 + ["real"] * 2
    assert all("val_loss" in r for r in records if r["step"] in (0, 2, 3, 4, 5) and "event" not in r)
    model = AutoModelForCausalLM.from_pretrained(output_dir / "real")
    assert (model.config.share_layers, len(model.model.layers)) == (False, 4)
    assert AutoTokenizer.from_pretrained(output_dir / "real").decode([104, 105]) == "hi"
    assert (output_dir / "pseudo" / "model.safetensors").is_file() and (output_dir / "loss.png").is_file()
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-5"]


@pytest.mark.slow
def test_the_installed_trainer_runs_from_every_entry_point_alike(tmp_path):
    """The trainer ships in the package: `hf-p2r train`, `python -m hf_p2r.train` and `accelerate launch -m
    hf_p2r.train`, started outside the repository (no scripts/ at hand), each train the same tiny run (bitwise the same
    losses), and a bad field is one line naming the command."""
    hf_p2r = str(Path(PYTHON).with_name("hf-p2r"))
    expected = None
    commands = {
        "hf-p2r": [hf_p2r, "train"],
        "python -m": [PYTHON, "-m", "hf_p2r.train"],
        "accelerate launch -m": [ACCELERATE, "launch", "-q", "--num_processes", "1", "--num_machines", "1",
                                 "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_p2r.train"],
    }  # fmt: skip
    for name, command in commands.items():
        output_dir = tmp_path / name.replace(" ", "_")
        overrides = tiny_argv(output_dir, pseudo_steps=2, real_steps=1, corpus_max_bytes=20000)
        result = subprocess.run(
            [*command, *overrides], capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=600
        )
        assert result.returncode == 0, (name, result.stderr[-3000:])
        expected = expected or trajectory(output_dir)
        assert trajectory(output_dir) == expected, name
        assert "***** run summary" in result.stdout, name
    bad = subprocess.run(
        [hf_p2r, "train", "--optimizer_carry", "cpy"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.splitlines() == [
        "hf-p2r train: error: argument --optimizer_carry/--optimizer-carry: invalid choice: 'cpy' (choose from "
        "'reset', 'copy', 'scale')"
    ], bad.stderr


@pytest.mark.slow
def test_two_processes_match_one_process_at_equal_global_batch(tmp_path):
    """Two gloo processes with 2 blocks each against one process with 4, through a delink (DDP re-wrapped).

    Same data, same updates: the difference is only the order of floating-point sums (DDP averages two per-process
    mean gradients; one process takes one mean over the 4 blocks), measured at most 1.2e-7 relative (float32
    rounding) over these steps. The tolerance 1e-5 leaves room for other CPUs' kernels and stays far below what one
    step changes in the loss (~1e-2), so a wrong batch split or a lost gradient all-reduce would fail it.
    """
    schedule = dict(pseudo_steps=3, real_steps=3, eval_steps=3, save_steps=3, checkpoint_format="accelerate")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train(parse_config(tiny_argv(one, per_device_batch_size=4, **schedule))) == 0
    _run(
        [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            str(_free_port()),
            TRAIN_SCRIPT,
            *tiny_argv(two, per_device_batch_size=2, **schedule),
        ]
    )
    single, double = trajectory(one), trajectory(two)
    assert [(r["step"], r["stage"], r.get("event")) for r in single] == [
        (r["step"], r["stage"], r.get("event")) for r in double
    ]
    for a, b in zip(single, double):
        for key in ("loss", "val_loss", "grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    assert [p.name for p in list_checkpoints(two)] == ["checkpoint-3", "checkpoint-6"]
    assert sorted(p.name for p in (two / "checkpoints/checkpoint-6").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert AutoModelForCausalLM.from_pretrained(two / "real").config.share_layers is False


@pytest.mark.slow
def test_evaluation_runs_the_same_forward_passes_on_every_process(tmp_path):
    """9 validation blocks over 2 processes with batches of 4: process 0 has 2 batches, process 1 one. Under FSDP2 /
    ZeRO-3 each forward is a collective, so process 1 runs its last batch again (the worker puts a collective in every
    forward, as they do) and drops its loss: the validation loss is still the mean over the 9 blocks. (Two spawned
    processes: what is tested is the engine's evaluation, not the launcher.)"""
    results = spawn.run(uneven_evaluation, 2, tmp_path)
    assert [r["forwards"] for r in results] == [2, 2]
    assert results[0]["val_loss"] == results[1]["val_loss"]
    assert results[0]["val_loss"] == pytest.approx(results[0]["expected"], rel=1e-6)


def _wait_for_step(process: subprocess.Popen, output_dir: Path, step: int) -> None:
    """Until the run has logged the training loss of `step` (then it is in the loop, its signal handlers set)."""
    deadline = time.monotonic() + PATIENCE
    while not any(r.get("step", 0) >= step and "loss" in r for r in read_metrics(output_dir / "metrics.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its new parent to reap it has exited)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def _check_stopped_with_a_checkpoint(output_dir: Path, signum: int, output: str) -> None:
    assert f"stopped by signal {signum} after step" in output, output[-3000:]
    last_record = read_metrics(output_dir / "metrics.jsonl")[-1]
    assert [p.name for p in list_checkpoints(output_dir)] == [f"checkpoint-{last_record['step']}"]
    assert not (output_dir / "real").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_saves_a_checkpoint_and_exits_128_plus_its_number(tmp_path, signum):
    output_dir = tmp_path / "run"
    command = [PYTHON, TRAIN_SCRIPT, *tiny_argv(output_dir, pseudo_steps=2, real_steps=10_000, eval_steps=0)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO
    )
    try:
        _wait_for_step(process, output_dir, 3)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=PATIENCE)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, stderr[-2000:]
    _check_stopped_with_a_checkpoint(output_dir, signum, stderr + stdout)


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["launcher", "process-group"])
def test_sigterm_to_the_launcher_stops_the_trainer_after_a_checkpoint(tmp_path, to_group):
    """`accelerate launch` with one process runs the script with Popen + wait and forwards no signal: SIGTERM ends the
    launcher alone. The trainer asked the kernel for SIGTERM when its parent dies (scripts/train.py), so it finishes
    its step, saves a checkpoint and exits instead of training on as an orphan that never saves.

    Sent to the process group (`timeout`, `kill -- -PGID`, systemd, SLURM), SIGTERM reaches the trainer twice: from
    the sender and as the launcher's death signal; the second must not cut the checkpoint short."""
    output_dir = tmp_path / "run"
    overrides = tiny_argv(output_dir, pseudo_steps=2, real_steps=10_000, eval_steps=0)
    command = [ACCELERATE, "launch", "-q", "--num_processes", "1", TRAIN_SCRIPT, *overrides]
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        start_new_session=True,  # its own process group, as under a shell's job control
    )
    trainers = []
    try:
        _wait_for_step(launcher, output_dir, 3)
        trainers = _children(launcher.pid)
        assert len(trainers) == 1, trainers
        if to_group:
            os.killpg(launcher.pid, signal.SIGTERM)
        else:
            launcher.send_signal(signal.SIGTERM)
        # The trainer holds the launcher's pipes too: they close when it has exited.
        stdout, stderr = launcher.communicate(timeout=PATIENCE)
        deadline = time.monotonic() + PATIENCE
        while _running(trainers[0]):
            assert time.monotonic() < deadline, "the trainer outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()
        for pid in trainers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == -signal.SIGTERM  # the launcher died of the signal (it has no handler)
    _check_stopped_with_a_checkpoint(output_dir, signal.SIGTERM, stderr + stdout)


@pytest.mark.slow
def test_a_run_started_from_a_shell_outlives_the_shell(tmp_path):
    """Without a launcher the trainer asks for no death signal: `nohup` / `setsid` runs survive their shell."""
    output_dir = tmp_path / "run"
    trainer = shlex.join([PYTHON, TRAIN_SCRIPT, *tiny_argv(output_dir, pseudo_steps=2, real_steps=8, eval_steps=0)])
    # The shell starts the trainer, waits for its first training step, and exits.
    script = f"{trainer} >/dev/null 2>&1 & echo $!; until [ -s {output_dir}/metrics.jsonl ]; do sleep 0.1; done"
    shell = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=PATIENCE)
    pid = int(shell.stdout)
    try:
        deadline = time.monotonic() + PATIENCE
        while _running(pid):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-10"]  # the whole run
    assert (output_dir / "real" / "config.json").is_file()


@pytest.mark.slow
def test_launcher_quiet_flag_leaves_the_one_line_error_without_a_traceback(tmp_path):
    """`accelerate launch -q` (Makefile, README) turns the trainer's exit code 2 into 1 without the launcher's
    CalledProcessError traceback; the trainer's one-line message is the only error line."""
    config = tmp_path / "bad.yaml"
    config.write_text("optimizer_carry: cpy\n")
    command = [ACCELERATE, "launch", "-q", "--num_processes", "1", TRAIN_SCRIPT, "--config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=120)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if "error" in line.lower()] == [
        f"train.py: error: config: {config}: optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'"
    ], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
