"""The training script as users run it: through `accelerate launch`, on one and on two CPU processes, and stopped
by SIGTERM."""

import signal
import socket
import subprocess
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.metrics import read_metrics

from .helpers import ACCELERATE, PYTHON, REPO, subprocess_env, tiny_argv, trajectory

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN_SCRIPT = str(REPO / "scripts/train.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=timeout)
    errors = [line for line in result.stderr.splitlines() if "train.py: error" in line]
    assert result.returncode == 0, "\n".join(errors) + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_demo_through_accelerate_launch(tmp_path):
    output_dir = tmp_path / "demo"
    # The README's command with the demo configuration, shrunk to a few steps of a tiny model.
    overrides = tiny_argv(output_dir, pseudo_steps=3, real_steps=2, eval_steps=2, corpus_max_bytes=20000)
    _run([ACCELERATE, "launch", "--num_processes", "1", TRAIN_SCRIPT, "--config", "configs/demo.yaml", *overrides])
    records = read_metrics(output_dir / "metrics.jsonl")
    assert [(r["step"], r["num_blocks"]) for r in records if r.get("event") == "delink"] == [(3, 4)]
    assert [r["stage"] for r in records if "loss" in r] == ["pseudo"] * 3 + ["real"] * 2
    assert all("val_loss" in r for r in records if r["step"] in (0, 2, 3, 4, 5) and "event" not in r)
    model = AutoModelForCausalLM.from_pretrained(output_dir / "real")
    assert (model.config.share_layers, len(model.model.layers)) == (False, 4)
    assert AutoTokenizer.from_pretrained(output_dir / "real").decode([104, 105]) == "hi"
    assert (output_dir / "pseudo" / "model.safetensors").is_file() and (output_dir / "loss.png").is_file()
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-5"]


@pytest.mark.slow
def test_two_processes_match_one_process_at_equal_global_batch(tmp_path):
    """Two gloo processes with 2 blocks each against one process with 4, through a delink (DDP re-wrapped).

    Same data, same updates: the difference is only the order of floating-point sums (DDP averages two per-process
    mean gradients; one process takes one mean over the 4 blocks), measured at most 1.2e-7 relative (float32
    rounding) over these steps. The tolerance 1e-5 leaves room for other CPUs' kernels and stays far below what one
    step changes in the loss (~1e-2), so a wrong batch split or a lost gradient all-reduce would fail it.
    """
    schedule = dict(pseudo_steps=3, real_steps=3, eval_steps=3, save_steps=3)
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
def test_sigterm_finishes_the_step_saves_a_checkpoint_and_exits_143(tmp_path):
    output_dir = tmp_path / "run"
    command = [PYTHON, TRAIN_SCRIPT, *tiny_argv(output_dir, pseudo_steps=2, real_steps=10_000, eval_steps=0)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO
    )
    try:
        deadline = time.monotonic() + 120
        while not any(r.get("step", 0) >= 3 and "loss" in r for r in read_metrics(output_dir / "metrics.jsonl")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "stopped by signal 15" in stderr + stdout
    last_record = read_metrics(output_dir / "metrics.jsonl")[-1]
    checkpoints = list_checkpoints(output_dir)
    assert [p.name for p in checkpoints] == [f"checkpoint-{last_record['step']}"]
    assert not (output_dir / "real").exists()
