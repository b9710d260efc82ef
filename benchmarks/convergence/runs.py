"""The convergence benchmarks' runs: the presets, the runs of the carry study, and running them (each run the
trainer's, in its own process, `jobs` at a time; a finished run leaves a marker, so an identical run can be reused)."""

import argparse
import concurrent.futures
import contextlib
import copy
import json
import multiprocessing
import os
import time
from pathlib import Path

import datasets
import torch

from benchmarks import harness, presets
from benchmarks.convergence.analysis import compare_seed
from benchmarks.harness import utc_now, write_text
from hf_p2r.training import parse_config, train
from hf_p2r.training.metrics import read_metrics

# Shared by every run of a preset; each run adds its schedule. Keys of "fields" are scripts/train.py fields. Both
# presets study 3 budgets over 3 seeds, of pseudo models that share 2 blocks.
STUDY = {"budgets": [0.5, 1.5, 2.0], "seeds": [0, 1, 2]}
SHARING = {"num_unique_layers": 2, "shared_lr_scale": "depth"}
PRESETS = {
    "cpu": {
        **STUDY,
        "total_steps": 300,
        "delink_steps": [50, 100, 150],
        "carry_delink_step": 100,
        "jobs": 2,
        "fields": {
            **presets.CPU_RUN,
            **presets.schedule(lr=2e-3, warmup=20, log_every=5, eval_every=25, eval_blocks=128),
            **SHARING,
            "cpu": True,
        },
    },
    "gpu": {
        # The whole standard library (about 12 MB, 734 files): even the longest scratch budget, 2 x 600 steps of
        # 16 x 512 tokens, stays under one epoch. Delink points at the CPU preset's fractions of the total.
        **STUDY,
        "total_steps": 600,
        "delink_steps": [100, 200, 300],
        "carry_delink_step": 200,
        "jobs": 1,
        "fields": {
            **presets.model(hidden=512, ffn=1536, heads=8, layers=16),
            **presets.data(block=512, batch=16, corpus=100_000_000),
            **presets.schedule(lr=1e-3, warmup=40, log_every=10, eval_every=25, eval_blocks=256),
            **SHARING,
            "mixed_precision": "bf16",
        },
    },
}
CARRIES = ("reset", "copy", "scale")
SAME_LR = "-samelr"  # the suffix of a run with `shared_lr_scale: none`
# Fields counted in optimizer steps: --steps scales them with the total.
STEP_FIELDS = ("warmup_steps", "eval_steps", "logging_steps")


def scaled(preset: dict, steps: int | None = None, overrides: dict | None = None) -> dict:
    """A copy of `preset` with `steps` total steps (every step count scaled alike) and `overrides` of its fields."""
    preset = copy.deepcopy(preset)
    if steps is not None:
        factor = steps / preset["total_steps"]
        preset["total_steps"] = steps
        preset["delink_steps"] = sorted({max(1, min(steps - 1, round(s * factor))) for s in preset["delink_steps"]})
        at = max(1, min(steps - 1, round(preset["carry_delink_step"] * factor)))
        preset["carry_delink_step"] = min(preset["delink_steps"], key=lambda s: abs(s - at))
        for name in STEP_FIELDS:
            preset["fields"][name] = max(1, round(preset["fields"][name] * factor))
    preset["fields"].update(overrides or {})
    return preset


def runs_of(preset: dict) -> dict[str, dict]:
    """{run name: its schedule fields}: scratch; each carry at one delink step; scale at the other delink steps; the
    fully shared pseudo model (k = 1, M6-10T's) with scale; and, for contrast, scale with `shared_lr_scale: none`
    (the presets' P2R runs use `depth`)."""
    total, at, k = preset["total_steps"], preset["carry_delink_step"], preset["fields"]["num_unique_layers"]
    runs = {"scratch": {"pseudo_steps": 0, "real_steps": total}}
    for carry in CARRIES:
        runs[f"k{k}-{carry}-at{at}"] = {"pseudo_steps": at, "real_steps": total - at, "optimizer_carry": carry}
    for step in preset["delink_steps"]:
        if step != at:
            runs[f"k{k}-scale-at{step}"] = {
                "pseudo_steps": step,
                "real_steps": total - step,
                "optimizer_carry": "scale",
            }
    if k != 1:
        runs[f"k1-scale-at{at}"] = {**runs[f"k{k}-scale-at{at}"], "num_unique_layers": 1}
    runs[f"k{k}-scale-at{at}{SAME_LR}"] = {**runs[f"k{k}-scale-at{at}"], "shared_lr_scale": "none"}
    return runs


def budget_runs(preset: dict) -> dict[str, dict]:
    """{name: schedule} of the extra scratch runs, each `fraction` of the total steps with its own full schedule;
    evaluated only at the end (their final loss is all the equal-loss speed-up needs)."""
    total = preset["total_steps"]
    return {
        f"scratch-x{fraction:g}": {"pseudo_steps": 0, "real_steps": max(1, round(total * fraction)), "eval_steps": 0}
        for fraction in preset["budgets"]
    }


def machine() -> dict:
    """The harness's machine description, dated, with the load average at the start, in the convergence pages'
    layout."""
    info = harness.machine()
    return {
        "date": utc_now(),
        **{key: info[key] for key in ("platform", "python", "torch", "cpu", "cpu_count", "torch_threads")},
        "gpu": info.get("gpu"),
        "load_average_at_start": os.getloadavg(),
    }


def load_at_end(info: dict, loads: list[float]) -> None:
    """Add to `info` (a `machine()`) the load average now and the largest 1-minute load of `loads` and now."""
    info["load_average_at_end"] = os.getloadavg()
    info["load_average_max"] = max(loads + [info["load_average_at_end"][0]])


def _override(text: str) -> tuple[str, str]:
    """--set's FIELD=VALUE as (field, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return key, value


def command_line(doc: str, presets: dict, workdir: str) -> argparse.ArgumentParser:
    """The command line of a convergence study (the dense one, the MoE one): its preset, where the runs and the report
    go, runs at a time, seeds, steps, scratch budgets and field overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(presets), default="cpu")
    parser.add_argument("--workdir", default=workdir, help=f"where the runs write (default: {workdir})")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    parser.add_argument("--jobs", type=int, help="runs at a time, each in its own process (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to repeat every run with (default: the preset's)")
    parser.add_argument("--steps", type=int, help="total steps; delink points, warm-up, evaluation scale alike")
    parser.add_argument("--budgets", type=float, nargs="*", help="extra scratch budgets, fractions of the total")
    parser.add_argument("--set", type=_override, nargs="+", default=[], metavar="FIELD=VALUE", help="field overrides")
    return parser


def trainer_argv(fields: dict) -> list[str]:
    """Trainer flags of `fields` (a list value becomes several arguments of one flag)."""
    argv = []
    for key, value in fields.items():
        argv += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def output_dir_of(argv: list[str]) -> Path:
    """The --output_dir of a run's trainer arguments."""
    return Path(argv[argv.index("--output_dir") + 1])


def tasks_of(preset: dict, runs: dict, budgets: dict, seeds: list[int], workdir: Path) -> list[tuple]:
    """(steps, seed, name, trainer argv, log) of every run of every seed, each in workdir/seedS/NAME and its argv
    checked by the trainer's parser (a bad --set fails here, before any run)."""
    tasks = []
    for seed in seeds:
        for name, schedule in {**runs, **budgets}.items():
            output_dir = workdir / f"seed{seed}" / name
            fields = {**preset["fields"], **schedule, "seed": seed, "output_dir": str(output_dir)}
            fields["overwrite_output_dir"] = True
            argv = trainer_argv(fields)
            parse_config(argv)
            output_dir.parent.mkdir(parents=True, exist_ok=True)
            steps = schedule["pseudo_steps"] + schedule["real_steps"]
            tasks.append((steps, seed, name, argv, str(output_dir.parent / f"{name}.log")))
    return tasks


def train_run(argv: list[str], log: str, threads: int) -> tuple[int, float]:
    """One training run, its output (progress bars included) into `log`, in this process or a pool worker: its exit
    code and wall time."""
    torch.set_num_threads(threads)
    datasets.disable_progress_bars()
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        code = train(parse_config(argv))
    return code, time.perf_counter() - started


def run_tasks(tasks: list[tuple], jobs: int, threads: int, loads: list[float]) -> bool:
    """Run (steps, seed, name, argv, log) tasks, `jobs` at a time, longest first; print one line per run."""
    tasks = sorted(tasks, key=lambda task: -task[0])

    def done(task, outcome) -> bool:
        (_, seed, name, argv, log), (code, seconds) = task, outcome
        loads.append(os.getloadavg()[0])
        print(
            f"   seed {seed} {name}: {'ok' if code == 0 else f'FAILED ({code}, see {log})'}, {seconds:.0f} s",
            flush=True,
        )
        if code == 0:  # marks the run finished, for `finished`
            write_text(output_dir_of(argv) / "bench_argv.json", json.dumps(argv))
        return code == 0

    if jobs == 1:
        return all(done(task, train_run(*task[3:], threads)) for task in tasks)
    # Spawned workers (not forked from a process holding torch's thread pools), each reused for many runs.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(train_run, *task[3:], threads): task for task in tasks}
        for future in concurrent.futures.as_completed(futures):
            if not done(futures[future], future.result()):
                pool.shutdown(cancel_futures=True)
                return False
    return True


def finished(output_dir: Path, argv: list[str]) -> bool:
    """Whether `output_dir` holds a finished run of exactly `argv` (its saved real model and the same arguments)."""
    marker = output_dir / "bench_argv.json"
    return (output_dir / "real").is_dir() and marker.is_file() and json.loads(marker.read_text()) == argv


def records_of(folder: Path, names) -> dict[str, list[dict]]:
    """{name: the metrics.jsonl records of folder/NAME} for each of `names`."""
    return {name: read_metrics(folder / name / "metrics.jsonl") for name in names}


def run_study(
    tasks: list[tuple], runs: dict, budgets: dict, seeds: list[int], workdir: Path, jobs: int, threads: int, reuse: bool
) -> dict | None:
    """`tasks` (`tasks_of`'s, in `workdir`), `jobs` at a time with `threads` torch threads each, then each seed's runs
    against its scratch run (`compare_seed`): {"machine" (with the load during the runs), "wall_time_s",
    "runs_reused", "per_seed"}; None when a run failed. With `reuse`, a run finished with the same arguments (by an
    earlier, interrupted benchmark) is not run again."""
    started = time.perf_counter()
    info = machine()
    info["torch_threads"] = threads
    todo = [task for task in tasks if not (reuse and finished(output_dir_of(task[3]), task[3]))]
    count = f"{len(todo)} of {len(tasks)}" if reuse else f"{len(tasks)}"
    print(f"{count} runs ({len(seeds)} seeds), {jobs} at a time; logs in {workdir}", flush=True)
    loads = [info["load_average_at_start"][0]]
    if not run_tasks(todo, jobs, threads, loads):
        return None
    names = {**runs, **budgets}
    per_seed = [compare_seed(seed, runs, records_of(workdir / f"seed{seed}", names), budgets) for seed in seeds]
    load_at_end(info, loads)
    return {
        "machine": info,
        "wall_time_s": time.perf_counter() - started,
        "runs_reused": len(tasks) - len(todo),
        "per_seed": per_seed,
    }


def parameters(run_dir: Path) -> int:
    """Parameters of the model saved in `run_dir` (its safetensors files' tensors)."""
    from safetensors import safe_open

    total = 0
    for path in run_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            total += sum(torch.Size(file.get_slice(name).get_shape()).numel() for name in file.keys())
    return total


def block_parameters(model_dir: Path) -> tuple[int, int]:
    """(parameters of one transformer block, parameters outside the blocks) of a saved real model."""
    from safetensors import safe_open

    block = total = 0
    depths = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            for name in file.keys():
                numel = torch.Size(file.get_slice(name).get_shape()).numel()
                total += numel
                if ".layers." in name:
                    depths.add(name.split(".layers.")[1].split(".")[0])
                    if ".layers.0." in name:
                        block += numel
    return block, total - len(depths) * block
