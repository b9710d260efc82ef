"""Shared settings for the training tests: a model and corpus small enough for a step in milliseconds."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_p2r.training import parse_config, train
from hf_p2r.training.metrics import read_metrics

from ..distributed.spawn import CPU_ONLY

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_unique_layers": 1,
    "block_size": 32,
    "corpus_max_bytes": 30000,
    "per_device_batch_size": 4,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "logging_steps": 1,
    "eval_steps": 2,
    "eval_blocks": 8,
    "save_total_limit": 100,
    "cpu": "true",
}

# L=4, k=1 -> 2 blocks at step 2 -> 4 blocks (real) at step 4, then 3 real steps.
TWO_DELINKS = dict(pseudo_steps=4, real_steps=3, partial_delink_steps=[2], partial_delink_blocks=[2])

# A two-stage pipeline (1F1B, two microbatches) of the tiny model with two blocks, their learning rate unscaled.
TWO_STAGES = dict(
    pipeline_parallel_size=2,
    pipeline_schedule="1f1b",
    num_microbatches=2,
    shared_lr_scale="none",
    num_unique_layers=2,
)


def tiny_argv(output_dir, **overrides) -> list[str]:
    """Command-line arguments for a tiny run into `output_dir` (values as strings, the way a shell passes them)."""
    fields = {**TINY, "output_dir": output_dir, **overrides}
    argv = []
    for key, value in fields.items():
        argv += [f"--{key}", *(str(v) for v in value)] if isinstance(value, list) else [f"--{key}", str(value)]
    return argv


def trained_run(fixture_name: str, **fields):
    """A module-scoped fixture named `fixture_name`: a tiny run with `fields` (`tiny_argv`'s overrides) trained once, in
    this process, into a fresh folder; its output_dir (tests copy it before they resume or change it)."""

    @pytest.fixture(scope="module", name=fixture_name)
    def run(tmp_path_factory):
        output_dir = tmp_path_factory.mktemp(fixture_name) / "run"
        assert train(parse_config(tiny_argv(output_dir, **fields))) == 0
        return output_dir

    return run


def demo_launch() -> list[str]:
    """`make demo`'s command line, as the Makefile runs it with no ARGS (continuation lines joined, `$(VENV)/bin/`
    dropped)."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    recipe = makefile.split("\ndemo:", 1)[1].splitlines()[1]
    return shlex.split(recipe.replace("$(VENV)/bin/", "").replace("$(ARGS)", ""))


def run_trainer(argv: list[str], command: list[str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """The trainer (`command`, default `python -m hf_p2r.train`) run on `argv` in a process of its own, from the
    repository root with `subprocess_env()`, its output captured as text."""
    command = command or [PYTHON, "-m", "hf_p2r.train"]
    return subprocess.run(
        [*command, *argv], capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=timeout
    )


def token_batches(n: int, batch: int = 2, seq: int = 12, seed: int = 0) -> list[torch.Tensor]:
    """`n` batches of random token ids of the tiny model's vocabulary (3-100: no special token), the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 101, (batch, seq), generator=generator) for _ in range(n)]


class LastMicroBatch:
    """`GranularOffload`'s `last_micro_batch` for `n` micro-batches per step, counted at each training forward."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls % self.n == 0


def loss_and_grads(model, ids, **kwargs):
    """One training forward and backward on `ids`; the outputs and the gradients by parameter name (then zeroed)."""
    outputs = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    outputs.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


def subprocess_env() -> dict[str, str]:
    """Offline, quiet, one thread per process (two processes share this machine's two cores), and no GPU: the runs
    these tests start are CPU runs, also on a machine with fewer GPUs than processes (see `spawn.CPU_ONLY`)."""
    return {
        **os.environ,
        **CPU_ONLY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


# What a resumed or distributed run must reproduce (the rest is timing and memory).
DETERMINISTIC = ("step", "stage", "num_blocks", "event", "loss", "lr", "grad_norm", "val_loss")


def trajectory(output_dir) -> list[dict]:
    """The deterministic part of every metrics record of a run."""
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in read_metrics(Path(output_dir) / "metrics.jsonl")]


def losses(output_dir, key="loss") -> list[float]:
    """Every value of `key` a run logged, in order."""
    return [record[key] for record in trajectory(output_dir) if key in record]


def run_on_every_process(
    root, name: str, fields: dict, checkpoint: int | None = None, source: str | None = None
) -> list[float]:
    """One run of a body started by `spawn.run`, trained by every process into `root / name` with `fields`; with
    `checkpoint`, resumed from its checkpoint of that step (the run `source` copied there first by process 0). The
    processes wait for each other before it and after it; returns its losses.

    The process group is the spawner's, kept for the next run: Accelerate's `end_training` leaves the default group to
    a caller that says it launched the processes itself (`FORK_LAUNCHED`, read when its state is first built, as
    `notebook_launcher` sets it); a data-parallel run would end it otherwise. `accelerate launch` runs of the trainer
    (tests/training/test_launch.py) keep the ending of the group covered."""
    os.environ["FORK_LAUNCHED"] = "1"
    output_dir = Path(root) / name
    if source is not None and dist.get_rank() == 0:
        shutil.copytree(Path(root) / source, output_dir)
    dist.barrier()
    if checkpoint is not None:
        fields = dict(fields, resume_from_checkpoint=f"{output_dir}/checkpoints/checkpoint-{checkpoint}")
    assert train(parse_config(tiny_argv(output_dir, **fields))) == 0
    dist.barrier()
    return losses(output_dir)
