"""Convergence benchmark: the real model trained from scratch against P2R (pseudo stage -> delink -> real stage).

Every run has the same data, seed, learning-rate schedule and total step budget; P2R runs differ in where they
delink and in how the optimizer state is carried. They train shared blocks with `shared_lr_scale: depth` (a block run
at n depths learns at 1/n of the rate), except one run with `none` for contrast. On one device a pseudo step costs
the same compute as a real step (the pseudo model runs at full depth), so equal steps are equal compute. Two
speed-ups per P2R run:

- to scratch's final loss (the primary figure): scratch steps (or training time) / P2R steps (or training time) to
  reach scratch's final validation loss, the crossing found by linear interpolation between evaluations ("not
  reached" when it never gets there);
- at equal final loss: the steps a scratch run with its own full schedule needs to end at the P2R run's final
  validation loss / the P2R run's steps. Extra scratch runs at other budgets (`budgets`, fractions of the total)
  give scratch's final loss against its budget; it is interpolated between budgets (linearly in log steps), and a
  loss outside their range gives a bound (e.g. <=0.50x).

    python scripts/bench_convergence.py --preset cpu     # 3 seeds x 11 runs, 2 at a time: about 13 min on 2 cores
    python scripts/bench_convergence.py --preset gpu     # the same runs, 600 steps of a 16-layer model (not run yet)

Every seed repeats all runs (the seed sets the initial weights, the validation split and the data order) and has its
own scratch reference; P2R runs are compared with scratch seed by seed (paired), then summarized over seeds.

Writes benchmarks/convergence.{json,md,png} (gpu: convergence_gpu.*; machine, date, load and total wall time
recorded); the runs themselves, and each run's log, go to --workdir. Training time excludes evaluation and saving
(`train_time_s` of metrics.jsonl); with --jobs 2 two runs share the machine, so times are comparable with each other,
not with a machine running one. For a quick check of the whole pipeline:

    python scripts/bench_convergence.py --steps 24 --seeds 0 --set hidden_size=32 intermediate_size=64 \
        --workdir /tmp/bench --out /tmp/bench/report
"""

import argparse
import concurrent.futures
import contextlib
import copy
import datetime
import json
import math
import multiprocessing
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

# Shared by every run of a preset; each run adds its schedule. Keys of "fields" are scripts/train.py fields.
PRESETS = {
    "cpu": {
        "total_steps": 300,
        "delink_steps": [50, 100, 150],
        "carry_delink_step": 100,
        "budgets": [0.5, 1.5, 2.0],
        "seeds": [0, 1, 2],
        "jobs": 2,
        "fields": {
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_unique_layers": 2,
            "shared_lr_scale": "depth",
            "corpus_max_bytes": 2_000_000,
            "block_size": 128,
            "per_device_batch_size": 8,
            "learning_rate": 2e-3,
            "warmup_steps": 20,
            "eval_steps": 25,
            "eval_blocks": 128,
            "logging_steps": 5,
            "cpu": True,
        },
    },
    "gpu": {
        # The whole standard library (about 12 MB, 734 files): even the longest scratch budget, 2 x 600 steps of
        # 16 x 512 tokens, stays under one epoch. Delink points at the CPU preset's fractions of the total.
        "total_steps": 600,
        "delink_steps": [100, 200, 300],
        "carry_delink_step": 200,
        "budgets": [0.5, 1.5, 2.0],
        "seeds": [0, 1, 2],
        "jobs": 1,
        "fields": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 16,
            "num_attention_heads": 8,
            "num_unique_layers": 2,
            "shared_lr_scale": "depth",
            "corpus_max_bytes": 100_000_000,
            "block_size": 512,
            "per_device_batch_size": 16,
            "learning_rate": 1e-3,
            "warmup_steps": 40,
            "eval_steps": 25,
            "eval_blocks": 256,
            "logging_steps": 10,
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


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """First x where the piecewise-linear curve through (x, loss) points comes down to `target`; None if never."""
    for (x0, y0), (x1, y1) in zip([(None, None), *points], points):
        if y1 <= target:
            if x0 is None or y0 == y1:
                return x1
            return x0 + (y0 - target) / (y0 - y1) * (x1 - x0)
    return None


def value_at(points: list[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve through (x, y) points (x increasing) at `x`, held constant beyond its ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return points[-1][1]


def equal_loss_steps(budgets: list[tuple[int, float]], loss: float) -> tuple[float, str]:
    """Steps a scratch run needs to end at `loss`, from (steps budget, final loss) of scratch runs with their own
    schedules: (steps, "=") interpolated between budgets, linearly in log(steps) (a loss curve is closer to a line
    there, so the interpolation leans less on the budgets' spacing); (smallest budget, "<=") when even the smallest
    budget ends at or below `loss`; (largest budget, ">") when even the largest does not reach it."""
    points = sorted(budgets)
    if points[0][1] <= loss:
        return float(points[0][0]), "<="
    log_steps = crossing([(math.log(steps), value) for steps, value in points], loss)
    return (float(points[-1][0]), ">") if log_steps is None else (math.exp(log_steps), "=")


def summarize(name: str, records: list[dict], pseudo_steps: int, target: float, scratch: dict) -> dict:
    """One run of one seed against that seed's scratch run (`scratch`: its "steps" and "time" to its final loss,
    `target`)."""
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


def gaps(run: dict, scratch: dict) -> dict:
    """Where a P2R run's deficit arises, in validation loss minus scratch's at the same step (same seed): at the
    delink (the pseudo stage, same compute), at the first evaluation after it, and at the end."""
    reference = scratch["val_curve"]
    curve, at = run["val_curve"], run["pseudo_steps"]
    after = next(((s, v) for s, v in curve if s > at), curve[-1])
    return {
        "at_delink": value_at(curve, at) - value_at(reference, at),
        "after_delink": after[1] - value_at(reference, after[0]),
        "final": curve[-1][1] - reference[-1][1],
    }


def compare_seed(seed: int, runs: dict, records: dict, budgets: dict) -> dict:
    """Every run of one seed against its scratch run: both speed-ups, the gaps, and scratch's loss per budget."""
    scratch_evals = [r for r in records["scratch"] if "val_loss" in r]
    target = scratch_evals[-1]["val_loss"]
    scratch = {
        "steps": scratch_evals[-1]["step"],
        "time": max(r["train_time_s"] for r in records["scratch"] if "train_time_s" in r),
    }
    budget_points = [(scratch["steps"], target)] + [
        (schedule["real_steps"], [r for r in records[name] if "val_loss" in r][-1]["val_loss"])
        for name, schedule in budgets.items()
    ]
    summaries = [summarize(name, records[name], runs[name]["pseudo_steps"], target, scratch) for name in runs]
    for summary in summaries:
        steps, bound = equal_loss_steps(budget_points, summary["final_val_loss"])
        summary["equal_loss_steps"], summary["equal_loss_bound"] = steps, bound
        summary["speedup_equal_loss"] = steps / scratch["steps"]
        if summary["pseudo_steps"]:
            summary["gaps"] = gaps(summary, summaries[0])
    return {"seed": seed, "target": target, "budget_losses": sorted(budget_points), "runs": summaries}


def _mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def aggregate(per_seed: list[dict]) -> list[dict]:
    """Per run, over seeds: final validation loss, its paired difference to scratch, the speed-ups and the gaps.

    A mean speed-up to scratch's final loss needs every seed to reach it (else None); the mean equal-loss speed-up
    carries a bound when some seed's value is one ("<=" or ">", None when they point both ways)."""
    names = [run["name"] for run in per_seed[0]["runs"]]
    rows = []
    for index, name in enumerate(names):
        runs = [seed["runs"][index] for seed in per_seed]
        losses = [run["final_val_loss"] for run in runs]
        deltas = [run["final_val_loss"] - seed["target"] for run, seed in zip(runs, per_seed)]
        speedups = [run["speedup_steps"] for run in runs]
        times = [run["speedup_time"] for run in runs]
        bounds = {run["equal_loss_bound"] for run in runs} - {"="}
        row = {
            "name": name,
            "pseudo_steps": runs[0]["pseudo_steps"],
            "final_val_loss_mean": statistics.fmean(losses),
            "delta_vs_scratch_mean": statistics.fmean(deltas),
            "delta_vs_scratch_sd": _mean_sd(deltas)["sd"],
            "speedup_steps_per_seed": speedups,
            "speedup_steps_mean": statistics.fmean(speedups) if None not in speedups else None,
            "speedup_time_mean": statistics.fmean(times) if None not in times else None,
            "speedup_equal_loss_per_seed": [[run["speedup_equal_loss"], run["equal_loss_bound"]] for run in runs],
            "speedup_equal_loss_mean": (
                None
                if len(bounds) > 1
                else [statistics.fmean(run["speedup_equal_loss"] for run in runs), bounds.pop() if bounds else "="]
            ),
        }
        if "gaps" in runs[0]:
            row["gaps"] = {key: _mean_sd([run["gaps"][key] for run in runs]) for key in runs[0]["gaps"]}
        rows.append(row)
    return rows


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


def _times(value: float | None, bound: str = "=") -> str:
    return "-" if value is None else f"{'' if bound == '=' else bound.replace('<=', '≤')}{value:.2f}x"


def markdown(result: dict) -> str:
    m, p, seeds, rows = result["machine"], result["preset"], result["seeds"], result["runs"]
    f = p["fields"]
    total = p["total_steps"]
    budgets = ", ".join(f"{x:g}" for x in p["budgets"])
    lines = [
        f"# Convergence: real model from scratch vs P2R ({result['preset_name']} preset)",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cpu_count']} cores, {result['jobs']} run(s) at a time, "
        f"{m['torch_threads']} torch thread(s) each"
        + (f", {m['gpu']}" if m["gpu"] else "")
        + f"), torch {m['torch']}, "
        f"Python {m['python']}; total wall time {result['wall_time_s'] / 60:.1f} min. Load average (1 min) "
        f"{m['load_average_at_start'][0]:.1f} at the start, {m['load_average_max']:.1f} at most (sampled after each "
        f"run), {m['load_average_at_end'][0]:.1f} at the end: times are noisy when it exceeds the core count; steps "
        "are not.",
        "",
        f"Model: L={f['num_hidden_layers']}, hidden {f['hidden_size']}, {result['parameters']['real']:,} parameters"
        + (
            f" (the pseudo model with k={f['num_unique_layers']}: {pseudo:,})"
            if (pseudo := result["parameters"]["pseudo"])
            else ""
        )
        + ". A run named "
        "kK-CARRY-atD trains a pseudo model with K shared blocks, delinks it at step D with that optimizer carry and "
        f"trains the real model on. Every run: {total} optimizer steps of {f['per_device_batch_size']} x "
        f"{f['block_size']} tokens ({total * f['per_device_batch_size'] * f['block_size']:,} tokens), the same data "
        f"order and cosine schedule (peak {f['learning_rate']:g}, {f['warmup_steps']} warm-up steps). P2R runs train "
        f"with `shared_lr_scale: {f.get('shared_lr_scale', 'none')}` (depth: a block shared by n depths learns at 1/n "
        "of the rate, so that its update changes the function about as much as an unshared block's), runs named "
        "-samelr with `none`. On one device a "
        "pseudo step costs the same compute as a real step (the pseudo model runs at full depth, it only has fewer "
        "distinct parameters), so a speed-up in steps is a speed-up in compute; the speed-up in training time is "
        "measured too. Seeds "
        f"{result['seed_list']}: each seed repeats every run (initial weights, validation split, data order); P2R is "
        "compared with scratch seed by seed.",
        "",
        "Two speed-ups:",
        "",
        "- **to scratch's final loss** (the issue's definition, primary): scratch steps (time) / P2R steps (time) to "
        f"reach scratch's final validation loss ({', '.join(format(s['target'], '.4f') for s in seeds)} by seed), "
        f"linear interpolation between evaluations every {f['eval_steps']} steps; the mean is shown only when every "
        "seed reached it. Under a cosine schedule every run's loss drops fastest in the final anneal, which "
        "compresses this measure towards 1x, and a run that ends above scratch's final loss gets no number.",
        "- **at equal final loss**: the steps scratch needs, with its own full schedule, to end at the P2R run's "
        f"final loss, / {total}. Scratch also runs with {budgets or 'no other'} x the budget; its final loss is "
        "interpolated linearly in log(steps) between budgets (≤ / >: outside their range, a bound).",
        "",
        "| run | delink at | final val loss (mean) | Δ vs scratch (mean ± sd) | to scratch's final loss, per seed "
        "| mean (steps) | mean (time) | at equal final loss, per seed | mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_seed = ", ".join("not reached" if x is None else _times(x) for x in row["speedup_steps_per_seed"])
        equal = ", ".join(_times(x, bound) for x, bound in row["speedup_equal_loss_per_seed"])
        equal_mean = row["speedup_equal_loss_mean"]
        lines.append(
            f"| {row['name']} | {row['pseudo_steps'] or '-'} | {row['final_val_loss_mean']:.4f} | "
            f"{row['delta_vs_scratch_mean']:+.4f} ± {row['delta_vs_scratch_sd']:.4f} | {per_seed} | "
            f"{_times(row['speedup_steps_mean'])} | {_times(row['speedup_time_mean'])} | {equal} | "
            f"{_times(*equal_mean) if equal_mean else '-'} |"
        )
    lines += ["", "Scratch's final validation loss against its step budget (each with its own schedule):", ""]
    lines += ["| steps | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for index, (steps, _) in enumerate(seeds[0]["budget_losses"]):
        lines.append(f"| {steps} | " + " | ".join(f"{s['budget_losses'][index][1]:.4f}" for s in seeds) + " |")
    lines += _verdict(rows) + _where_the_gap_arises(rows, f["eval_steps"])
    lines += [
        "",
        f"Curves (`{result['plot']}`): every run's mean over the {len(seeds)} seeds, the band spanning their minimum "
        "to maximum; the difference to scratch is taken seed by seed before averaging.",
        "",
    ]
    return "\n".join(lines)


def _verdict(rows: list[dict]) -> list[str]:
    """The best P2R run by each measure, against the 1.5x target, in measured numbers."""
    p2r = rows[1:]
    reached = [r for r in p2r if r["speedup_steps_mean"] is not None]
    best = max(reached, key=lambda r: r["speedup_steps_mean"], default=None)
    exact = [r for r in p2r if r["speedup_equal_loss_mean"]]
    best_equal = max(exact, key=lambda r: r["speedup_equal_loss_mean"][0], default=None)
    closest = min(p2r, key=lambda r: r["delta_vs_scratch_mean"], default=None)
    sentences = ["**Result** (target: 1.5x)."]
    if best:
        met = "meets" if best["speedup_steps_mean"] >= 1.5 else "misses"
        sentences.append(
            f"To scratch's final loss, the best P2R run is {best['name']} at {best['speedup_steps_mean']:.2f}x in "
            f"steps (mean over seeds): it {met} the target."
        )
    else:
        sentences.append("To scratch's final loss: no P2R run reached it with every seed.")
    if best_equal:
        value, bound = best_equal["speedup_equal_loss_mean"]
        met = "it meets the target" if value >= 1.5 else "it misses the target"
        if (bound == ">" and value < 1.5) or (bound == "<=" and value >= 1.5):
            met = "a bound, which does not tell whether it meets the target (the budgets do not reach far enough)"
        sentences.append(
            f"At equal final loss, the best is {best_equal['name']} at {_times(value, bound)} (mean over seeds): {met}."
        )
    if closest:
        sentences.append(
            f"The smallest final deficit is {closest['name']}'s, {closest['delta_vs_scratch_mean']:+.4f} ± "
            f"{closest['delta_vs_scratch_sd']:.4f} nats against scratch."
        )
    return ["", " ".join(sentences)]


def _where_the_gap_arises(rows: list[dict], eval_steps: int) -> list[str]:
    """A table of each P2R run's gap to scratch at the delink, just after it and at the end, and a reading of it."""
    p2r = [r for r in rows if "gaps" in r]
    if not p2r:
        return []
    lines = [
        "",
        "Where the gap arises: validation loss minus scratch's at the same step and seed (mean ± sd over seeds), at "
        "the delink (after the pseudo stage, which had the same steps and compute as scratch but k/L of the layer "
        f"parameters), at the first evaluation after it (at most {eval_steps} steps later: a jump here is the delink's "
        "cost: optimizer carry, learning rate), and at the end.",
        "",
        "| run | at the delink | first evaluation after | final | change over the real stage |",
        "|---|---|---|---|---|",
    ]
    for row in p2r:
        g = row["gaps"]
        change = g["final"]["mean"] - g["at_delink"]["mean"]
        cells = " | ".join(
            f"{g[key]['mean']:+.4f} ± {g[key]['sd']:.4f}" for key in ("at_delink", "after_delink", "final")
        )
        lines.append(f"| {row['name']} | {cells} | {change:+.4f} |")
    recipe = [r for r in p2r if not r["name"].endswith(SAME_LR)]
    if recipe:
        mean = {key: statistics.fmean(r["gaps"][key]["mean"] for r in recipe) for key in recipe[0]["gaps"]}
        spread = statistics.fmean(r["gaps"]["final"]["sd"] for r in recipe)
        lines += [
            "",
            f"Averaged over the P2R runs other than -samelr: {mean['at_delink']:+.4f} at the delink, "
            f"{mean['after_delink']:+.4f} at the first evaluation after it, {mean['final']:+.4f} at the end (for "
            f"scale: the final gap's sd over seeds averages {spread:.4f}).",
        ]
    by_name = {r["name"]: r for r in p2r}
    for name in [n for n in by_name if n.endswith(SAME_LR) and n.removesuffix(SAME_LR) in by_name]:
        same, scaled_lr = by_name[name]["gaps"], by_name[name.removesuffix(SAME_LR)]["gaps"]
        lines.append(
            f"The shared blocks' learning rate, {name.removesuffix(SAME_LR)} against {name}: "
            f"{scaled_lr['at_delink']['mean']:+.4f} against {same['at_delink']['mean']:+.4f} at the delink, "
            f"{scaled_lr['final']['mean']:+.4f} against {same['final']['mean']:+.4f} at the end."
        )
    return lines


def _band(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x (mean over seeds), and the mean, minimum and maximum of y, over curves sampled at the same points."""
    columns = list(zip(*curves))
    xs = [statistics.fmean(x for x, _ in column) for column in columns]
    ys = [[y for _, y in column] for column in columns]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    seeds = result["seeds"]
    names = [run["name"] for run in seeds[0]["runs"]]
    palette = [plt.cm.tab10(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]  # no gray: scratch's band is gray
    colors = {name: "black" if i == 0 else palette[(i - 1) % len(palette)] for i, name in enumerate(names)}
    figure, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    (by_step, by_real, by_time), (by_gap, by_budget, legend) = axes

    def draw(ax, curves, name, **style):
        xs, mean, low, high = _band(curves)
        width = 2.2 if name == "scratch" else 1.2
        ax.plot(xs, mean, color=colors[name], linewidth=width, label=name, **style)
        ax.fill_between(xs, low, high, color=colors[name], alpha=0.15, linewidth=0)

    for index, name in enumerate(names):
        runs = [seed["runs"][index] for seed in seeds]
        at = runs[0]["pseudo_steps"]
        draw(by_step, [run["val_curve"] for run in runs], name)
        draw(by_real, [[(s - at, v) for s, v in run["val_curve"] if s >= at] for run in runs], name)
        draw(by_time, [run["time_curve"] for run in runs], name)
        if name != "scratch":
            scratch = [seed["runs"][0]["val_curve"] for seed in seeds]
            draw(
                by_gap,
                [[(s, v - value_at(ref, s)) for s, v in run["val_curve"]] for run, ref in zip(runs, scratch)],
                name,
            )
            final = statistics.fmean(run["final_val_loss"] for run in runs)
            by_budget.axhline(final, color=colors[name], linestyle="--", linewidth=1)
    draw(by_budget, [seed["budget_losses"] for seed in seeds], "scratch", marker="o")
    by_budget.set_xscale("log")
    by_budget.minorticks_off()
    budget_steps = [steps for steps, _ in seeds[0]["budget_losses"]]
    by_budget.set_xticks(budget_steps, [str(steps) for steps in budget_steps])
    target = statistics.fmean(seed["target"] for seed in seeds)
    lows = [v for seed in seeds for run in seed["runs"] for _, v in run["val_curve"]]
    labels = ("total optimizer steps", "real-model steps (after the delink)", "training time (s)")
    for ax, label in zip((by_step, by_real, by_time), labels):
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_ylim(min(lows) - 0.05, target + 1.0)
    by_gap.axhline(0.0, color="black", linewidth=1)
    by_gap.set_xlabel("total optimizer steps")
    by_gap.set_ylabel("validation loss minus scratch's (same seed)")
    by_budget.set_xlabel("scratch's step budget, each with its own schedule (dashed: P2R runs' final loss)")
    by_budget.set_ylabel("final validation loss")
    for ax in (*axes[0], by_gap, by_budget):
        ax.grid(alpha=0.3)
    legend.axis("off")
    legend.legend(*by_step.get_legend_handles_labels(), loc="center", fontsize=10)
    figure.suptitle(
        f"P2R vs scratch ({result['preset_name']} preset): mean over seeds {result['seed_list']}, band: min to max; "
        "dotted: scratch's final val loss (mean)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _train_run(argv: list[str], log: str, threads: int) -> tuple[int, float]:
    """One training run, its output (progress bars included) into `log`, in this process or a pool worker: its exit
    code and wall time."""
    torch.set_num_threads(threads)
    datasets.disable_progress_bars()
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        code = train(parse_config(argv))
    return code, time.perf_counter() - started


def _parameters(run_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in run_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            total += sum(torch.Size(file.get_slice(name).get_shape()).numel() for name in file.keys())
    return total


def _override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workdir", default="runs/bench", help="where the runs write (default: runs/bench)")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    parser.add_argument("--jobs", type=int, help="runs at a time, each in its own process (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to repeat every run with (default: the preset's)")
    parser.add_argument("--steps", type=int, help="total steps; delink points, warm-up, evaluation scale alike")
    parser.add_argument("--runs", nargs="+", help="only these runs (scratch is always run: it is the reference)")
    parser.add_argument("--budgets", type=float, nargs="*", help="extra scratch budgets, fractions of the total")
    parser.add_argument("--set", type=_override, nargs="+", default=[], metavar="FIELD=VALUE", help="field overrides")
    args = parser.parse_args(argv)
    preset = scaled(PRESETS[args.preset], args.steps, dict(args.set))
    if args.budgets is not None:
        preset["budgets"] = args.budgets
    seeds, jobs = args.seeds or preset["seeds"], args.jobs or preset["jobs"]
    runs = runs_of(preset)
    if args.runs:
        unknown = sorted(set(args.runs) - set(runs))
        if unknown:
            parser.error(f"--runs: unknown {unknown}; this preset has {sorted(runs)}")
        runs = {name: schedule for name, schedule in runs.items() if name == "scratch" or name in args.runs}
    budgets = budget_runs(preset)
    started = time.perf_counter()
    info = machine()
    info["torch_threads"] = args.threads

    # Every (seed, run), longest first so that the last runs to finish are short ones.
    tasks = []
    for seed in seeds:
        for name, schedule in {**runs, **budgets}.items():
            output_dir = Path(args.workdir) / args.preset / f"seed{seed}" / name
            fields = {**preset["fields"], **schedule, "seed": seed, "output_dir": str(output_dir)}
            fields["overwrite_output_dir"] = True
            argv_run = [item for key, value in fields.items() for item in (f"--{key}", str(value))]
            parse_config(argv_run)  # a bad --set fails here, before any run
            output_dir.parent.mkdir(parents=True, exist_ok=True)
            steps = schedule["pseudo_steps"] + schedule["real_steps"]
            tasks.append((steps, seed, name, argv_run, str(output_dir.parent / f"{name}.log")))
    tasks.sort(key=lambda task: -task[0])
    print(f"{len(tasks)} runs ({len(seeds)} seeds), {jobs} at a time; logs in {Path(args.workdir) / args.preset}")
    loads = [info["load_average_at_start"][0]]

    def done(task, outcome) -> bool:
        (_, seed, name, _, log), (code, seconds) = task, outcome
        loads.append(os.getloadavg()[0])
        print(
            f"   seed {seed} {name}: {'ok' if code == 0 else f'FAILED ({code}, see {log})'}, {seconds:.0f} s",
            flush=True,
        )
        return code == 0

    if jobs == 1:
        if not all(done(task, _train_run(*task[3:], args.threads)) for task in tasks):
            return 1
    else:
        # Spawned workers (not forked from a process holding torch's thread pools), each reused for many runs.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {pool.submit(_train_run, *task[3:], args.threads): task for task in tasks}
            for future in concurrent.futures.as_completed(futures):
                if not done(futures[future], future.result()):
                    pool.shutdown(cancel_futures=True)
                    return 1

    per_seed = []
    for seed in seeds:
        folder = Path(args.workdir) / args.preset / f"seed{seed}"
        records = {name: read_metrics(folder / name / "metrics.jsonl") for name in {**runs, **budgets}}
        per_seed.append(compare_seed(seed, runs, records, budgets))
    info["load_average_at_end"] = os.getloadavg()
    info["load_average_max"] = max(loads + [info["load_average_at_end"][0]])
    # Parameter counts from the saved models: scratch's real model, and a pseudo model with the preset's k.
    folder = Path(args.workdir) / args.preset / f"seed{seeds[0]}"
    k = preset["fields"]["num_unique_layers"]
    pseudo = [name for name, s in runs.items() if s["pseudo_steps"] and s.get("num_unique_layers", k) == k]
    parameters = {
        "real": _parameters(folder / "scratch" / "real"),
        "pseudo": _parameters(folder / pseudo[0] / "pseudo") if pseudo else None,
    }
    stem = report_stem(args.preset)
    result = {
        "preset_name": args.preset,
        "preset": preset,
        "machine": info,
        "jobs": jobs,
        "seed_list": seeds,
        "wall_time_s": time.perf_counter() - started,
        "parameters": parameters,
        "plot": f"{stem}.png",
        "runs": aggregate(per_seed),
        "seeds": per_seed,
    }
    write_report(result, Path(args.out))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
