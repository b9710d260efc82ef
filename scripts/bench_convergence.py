"""Convergence benchmark: the real model trained from scratch against P2R (pseudo stage -> delink -> real stage).

Every run has the same data, seed, learning-rate schedule and total step budget; P2R runs differ in where they
delink and in how the optimizer state is carried. For each P2R run the speed-up is

    scratch steps (or training time) / P2R steps (or training time) to reach scratch's final validation loss,

with the crossing found by linear interpolation between evaluations ("not reached" when it never gets there).

    python scripts/bench_convergence.py --preset cpu     # 3 seeds x 8 runs of 300 steps: ~20 min, 2 CPU cores
    python scripts/bench_convergence.py --preset gpu     # 3 seeds x 8 runs of 1,200 steps on one GPU (not run yet)

Every seed repeats all runs (the seed sets the initial weights, the validation split and the data order) and has its
own scratch target; P2R runs are compared with scratch seed by seed (paired), then summarized over seeds.

Writes benchmarks/convergence.{json,md,png} (gpu: convergence_gpu.*; machine and date recorded); the runs themselves
go to --workdir.
Training time excludes evaluation and saving (`train_time_s` of metrics.jsonl); on a shared machine it is noisy.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import datasets
import torch

from hf_p2r.training import parse_config, train
from hf_p2r.training.metrics import read_metrics

# Shared by every run of a preset; each run adds its schedule. Keys are scripts/train.py fields.
PRESETS = {
    "cpu": {
        "total_steps": 300,
        "delink_steps": [50, 100, 150],
        "carry_delink_step": 100,
        "fields": {
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_unique_layers": 2,
            "corpus_max_bytes": 2_000_000,
            "block_size": 128,
            "per_device_batch_size": 8,
            "learning_rate": 2e-3,
            "warmup_steps": 20,
            "eval_steps": 20,
            "eval_blocks": 128,
            "logging_steps": 5,
            "cpu": True,
        },
    },
    "gpu": {
        # The whole standard library (about 12 MB, 734 files): 1,200 steps of 16 x 512 tokens stay under one epoch.
        "total_steps": 1200,
        "delink_steps": [150, 300, 600],
        "carry_delink_step": 300,
        "fields": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 16,
            "num_attention_heads": 8,
            "num_unique_layers": 2,
            "corpus_max_bytes": 100_000_000,
            "block_size": 512,
            "per_device_batch_size": 16,
            "learning_rate": 1e-3,
            "warmup_steps": 60,
            "eval_steps": 50,
            "eval_blocks": 256,
            "logging_steps": 10,
            "mixed_precision": "bf16",
        },
    },
}
CARRIES = ("reset", "copy", "scale")


def runs_of(preset: dict) -> dict[str, dict]:
    """{run name: its schedule fields}: scratch; each carry (and reset + rewarm) at one delink step; scale at the other
    delink steps; and the fully shared pseudo model (k = 1) with scale."""
    total, at, k = preset["total_steps"], preset["carry_delink_step"], preset["fields"]["num_unique_layers"]
    runs = {"scratch": {"pseudo_steps": 0, "real_steps": total}}
    for carry in CARRIES:
        runs[f"k{k}-{carry}-at{at}"] = {"pseudo_steps": at, "real_steps": total - at, "optimizer_carry": carry}
    runs[f"k{k}-reset-rewarm-at{at}"] = {
        **runs[f"k{k}-reset-at{at}"],
        "lr_after_delink": "rewarm",
    }
    for step in preset["delink_steps"]:
        if step != at:
            runs[f"k{k}-scale-at{step}"] = {
                "pseudo_steps": step,
                "real_steps": total - step,
                "optimizer_carry": "scale",
            }
    if k != 1:
        runs[f"k1-scale-at{at}"] = {**runs[f"k{k}-scale-at{at}"], "num_unique_layers": 1}
    return runs


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """First x where the piecewise-linear curve through (x, loss) points comes down to `target`; None if never."""
    for (x0, y0), (x1, y1) in zip([(None, None), *points], points):
        if y1 <= target:
            if x0 is None or y0 == y1:
                return x1
            return x0 + (y0 - target) / (y0 - y1) * (x1 - x0)
    return None


def summarize(name: str, records: list[dict], pseudo_steps: int, target: float, scratch: dict) -> dict:
    evaluations = [r for r in records if "val_loss" in r]
    # train_time_s is logged with the training loss; evaluations at the same step share it.
    time_at = {r["step"]: r["train_time_s"] for r in records if "train_time_s" in r}
    time_at[0] = 0.0
    by_step = [(r["step"], r["val_loss"]) for r in evaluations]
    by_time = [(time_at[r["step"]], r["val_loss"]) for r in evaluations if r["step"] in time_at]
    steps = crossing(by_step, target)
    seconds = crossing(by_time, target)
    return {
        "name": name,
        "pseudo_steps": pseudo_steps,
        "final_val_loss": evaluations[-1]["val_loss"],
        "train_time_s": max(time_at.values()),
        "steps_to_target": steps,
        "real_steps_to_target": None if steps is None else max(0.0, steps - pseudo_steps),
        "time_to_target_s": seconds,
        "speedup_steps": None if not steps else scratch["steps"] / steps,
        "speedup_time": None if not seconds else scratch["time"] / seconds,
        "val_curve": by_step,
        "time_curve": by_time,
    }


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average_at_start": os.getloadavg(),
    }


def report_stem(preset: str) -> str:
    return "convergence" if preset == "cpu" else f"convergence_{preset}"


def write_report(result: dict, out: Path) -> None:
    """convergence.{json,md,png} for the CPU preset, convergence_<preset>.* for the others."""
    out.mkdir(parents=True, exist_ok=True)
    stem = report_stem(result["preset_name"])
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(markdown(result), encoding="utf-8")
    if not plot(result, out / f"{stem}.png"):
        print(f"matplotlib is not installed: skipped {stem}.png")


def aggregate(per_seed: list[dict]) -> list[dict]:
    """Per run, over seeds: final validation loss, its paired difference to scratch, and the speed-ups."""
    names = [run["name"] for run in per_seed[0]["runs"]]
    rows = []
    for index, name in enumerate(names):
        runs = [seed["runs"][index] for seed in per_seed]
        losses = [run["final_val_loss"] for run in runs]
        deltas = [run["final_val_loss"] - seed["target"] for run, seed in zip(runs, per_seed)]
        speedups = [run["speedup_steps"] for run in runs]
        reached = [x for x in speedups if x is not None]
        times = [run["speedup_time"] for run in runs if run["speedup_time"] is not None]
        rows.append(
            {
                "name": name,
                "pseudo_steps": runs[0]["pseudo_steps"],
                "final_val_loss_mean": statistics.fmean(losses),
                "delta_vs_scratch_mean": statistics.fmean(deltas),
                "delta_vs_scratch_sd": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                "speedup_steps_per_seed": speedups,
                "speedup_steps_mean": statistics.fmean(reached) if len(reached) == len(speedups) else None,
                "speedup_time_mean": statistics.fmean(times) if len(times) == len(speedups) else None,
            }
        )
    return rows


def markdown(result: dict) -> str:
    m, p, seeds = result["machine"], result["preset"], result["seeds"]
    times = lambda value: "-" if value is None else f"{value:.2f}x"  # noqa: E731
    lines = [
        f"# Convergence: real model from scratch vs P2R ({result['preset_name']} preset)",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cpu_count']} cores, {m['torch_threads']} torch threads"
        + (f", {m['gpu']}" if m["gpu"] else "")
        + f"), torch {m['torch']}, Python {m['python']}; load average {m['load_average_at_start'][0]:.1f} at the "
        f"start, {m['load_average_at_end'][0]:.1f} at the end (times are noisy when it exceeds the core count; "
        "steps are not).",
        "",
        f"Model: L={p['fields']['num_hidden_layers']}, hidden {p['fields']['hidden_size']}; a run named kK-CARRY-atD "
        "trains a pseudo model with K shared blocks, delinks it at step D with that optimizer carry and trains the "
        f"real model on. Every run: {p['total_steps']} optimizer steps of {p['fields']['per_device_batch_size']} x "
        f"{p['fields']['block_size']} tokens, the same data order and cosine schedule. Seeds {result['seed_list']}: "
        "each seed repeats every run (initial weights, validation split, data order) and has its own target, "
        "scratch's final validation loss "
        f"({', '.join(format(seed['target'], '.4f') for seed in seeds)}). "
        "Δ = final validation loss minus scratch's, same seed (negative: P2R ends lower). "
        "Speed-up = scratch steps (time) / steps (time) to reach the target, linear "
        f"interpolation between evaluations every {p['fields']['eval_steps']} steps; the mean is over seeds, shown "
        "only when every seed reached the target.",
        "",
        "| run | delink at | final val loss (mean) | Δ vs scratch (mean ± sd) | speed-up in steps, per seed "
        "| speed-up (steps), mean | speed-up (time), mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        per_seed = ", ".join(times(x) if x is not None else "not reached" for x in row["speedup_steps_per_seed"])
        lines.append(
            f"| {row['name']} | {row['pseudo_steps'] or '-'} | {row['final_val_loss_mean']:.4f} | "
            f"{row['delta_vs_scratch_mean']:+.4f} ± {row['delta_vs_scratch_sd']:.4f} | {per_seed} | "
            f"{times(row['speedup_steps_mean'])} | {times(row['speedup_time_mean'])} |"
        )
    ranked = [r for r in result["runs"][1:] if r["speedup_steps_mean"]]
    best = max(ranked, key=lambda r: r["speedup_steps_mean"], default=None)
    lines += [
        "",
        "Best P2R run (mean over seeds): "
        + (
            f"{best['name']}, {best['speedup_steps_mean']:.2f}x in steps (target 1.5x)."
            if best
            else "none reached scratch's final validation loss with every seed."
        ),
        "",
        f"Curves (`{result['plot']}`): seed {seeds[0]['seed']}.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    first = result["seeds"][0]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    for run in first["runs"]:
        style = {"linewidth": 2.2, "color": "black"} if run["name"] == "scratch" else {"linewidth": 1.2}
        steps, losses = zip(*run["val_curve"])
        axes[0].plot(steps, losses, label=run["name"], **style)
        real = [(s - run["pseudo_steps"], v) for s, v in run["val_curve"] if s >= run["pseudo_steps"]]
        axes[1].plot(*zip(*real), **style)
        axes[2].plot(*zip(*run["time_curve"]), **style)
    for ax, label in zip(axes, ("total optimizer steps", "real-model steps (after the delink)", "training time (s)")):
        ax.axhline(first["target"], color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/token)")
    axes[0].legend(fontsize=8)
    lows = [v for run in first["runs"] for _, v in run["val_curve"]]
    axes[0].set_ylim(min(lows) - 0.05, first["target"] + 1.0)
    figure.suptitle(
        f"P2R vs scratch ({result['preset_name']} preset, seed {first['seed']}; dotted: scratch's final val loss)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workdir", default="runs/bench", help="where the runs write (default: runs/bench)")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on busy hosts)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to repeat every run with")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    runs = runs_of(preset)

    info = machine()
    per_seed = []
    for seed in args.seeds:
        records = {}
        for name, schedule in runs.items():
            output_dir = Path(args.workdir) / args.preset / f"seed{seed}" / name
            fields = {
                **preset["fields"],
                **schedule,
                "seed": seed,
                "output_dir": str(output_dir),
                "overwrite_output_dir": True,
            }
            argv_run = [item for key, value in fields.items() for item in (f"--{key}", str(value))]
            print(f"== seed {seed}: {name}", flush=True)
            started = time.perf_counter()
            if train(parse_config(argv_run)) != 0:
                return 1
            print(f"   {time.perf_counter() - started:.0f} s", flush=True)
            records[name] = read_metrics(output_dir / "metrics.jsonl")
        scratch_evals = [r for r in records["scratch"] if "val_loss" in r]
        target = scratch_evals[-1]["val_loss"]
        scratch = {
            "steps": scratch_evals[-1]["step"],
            "time": max(r["train_time_s"] for r in records["scratch"] if "train_time_s" in r),
        }
        summaries = [summarize(name, records[name], runs[name]["pseudo_steps"], target, scratch) for name in runs]
        per_seed.append({"seed": seed, "target": target, "runs": summaries})
    info["load_average_at_end"] = os.getloadavg()

    stem = report_stem(args.preset)
    result = {
        "preset_name": args.preset,
        "preset": preset,
        "machine": info,
        "seed_list": args.seeds,
        "plot": f"{stem}.png",
        "runs": aggregate(per_seed),
        "seeds": per_seed,
    }
    write_report(result, Path(args.out))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
