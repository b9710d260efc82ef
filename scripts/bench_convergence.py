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
    """convergence_carry.* (the optimizer-carry study at L = 8) for the CPU preset: convergence.* is the sweep page."""
    return "convergence_carry" if preset == "cpu" else f"convergence_{preset}"


def write_report(result: dict, out: Path) -> None:
    """convergence_carry.{json,md,png} for the CPU preset, convergence_<preset>.* for the others."""
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


# Sweeps (issue 13): when does P2R pay off? The learning-rate schedule, the depth, the growth schedule and the delink
# point, each on two corpora; every P2R run compared seed by seed with a scratch run of its group (same corpus,
# depth and schedule). `--sweep NAME` runs one and writes convergence_NAME.json; `--report` builds convergence.md
# (findings, tables) and its plots from every sweep file present.
SWEEPS = ("schedule", "depth", "growth", "best")
CORPORA = {
    "stdlib": "the standard library's Python sources (code; the trainer's built-in corpus)",
    "prose": "English prose made by the benchmark from Python's own documentation: pydoc's topics "
    "(pydoc_data.topics) and the docstrings of the standard library, one document per topic or module",
}
# Training state per parameter, fp32: the weight, its gradient and AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 16
SWEEP_DEFAULTS = {
    "schedule": {"schedulers": ["cosine", "wsd"], "depths": [8], "fractions": [1 / 3]},
    # Under the schedule that gives P2R the larger speed-up in the schedule sweep (cosine; see the findings).
    "depth": {"schedulers": ["cosine"], "depths": [8, 16, 32], "fractions": [1 / 3]},
    "growth": {"schedulers": ["cosine"], "depths": [8], "fractions": [1 / 6, 1 / 3, 1 / 2]},
    # The recommended configuration (--only) at every seed, on both corpora: what the target is judged on.
    "best": {"schedulers": ["cosine"], "depths": [8], "fractions": [1 / 3]},
}
TARGET = 1.5


def prose_corpus(folder: Path, max_bytes: int) -> Path:
    """A folder of .txt documents of English prose, about `max_bytes` of them, made from what every Python ships:
    pydoc's help topics, then each standard-library module's docstrings (module, classes, functions) in the order of
    a hash of its path. Made once (written to a temporary folder, then renamed); the same on every machine with the
    same Python version."""
    if folder.is_dir():
        return folder
    import ast
    import hashlib
    import pydoc_data.topics
    import shutil
    import sysconfig

    documents = [text for _, text in sorted(pydoc_data.topics.topics.items())]
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = [path for path in root.rglob("*.py") if not skip & set(path.relative_to(root).parts)]
    files.sort(key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        text = "\n\n".join(
            doc for node in ast.walk(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node))
        )
        if text:
            documents.append(text)
    temporary = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    total = 0
    for index, text in enumerate(documents):
        size = len(text.encode())
        if total + size > max_bytes:
            continue
        (temporary / f"{index:04d}.txt").write_text(text, encoding="utf-8")
        total += size
    temporary.rename(folder)
    return folder


def corpus_fields(corpus: str, preset: dict, workdir: Path) -> dict:
    """The trainer fields that select `corpus` (the built-in corpus needs none)."""
    if corpus == "stdlib":
        return {}
    folder = prose_corpus(
        workdir / "corpora" / f"prose-{preset['fields']['corpus_max_bytes']}", preset["fields"]["corpus_max_bytes"]
    )
    return {"train_files": [str(folder)]}


def p2r_schedule(total: int, at: int, k: int, depth: int, grow: bool = False) -> tuple[str, dict]:
    """(name, schedule) of a P2R run with k shared blocks, delinked to the real model at step `at` (scale carry).

    With `grow`, the pseudo model doubles its blocks at evenly spaced partial delinks before that (1 -> 2 -> 4 -> L):
    each stage trains at least as long as the one before has blocks to share."""
    schedule = {"pseudo_steps": at, "real_steps": total - at, "num_unique_layers": k, "optimizer_carry": "scale"}
    if not grow:
        return f"k{k}-at{at}", schedule
    blocks = []
    while (k if not blocks else blocks[-1]) * 2 < depth:
        blocks.append((k if not blocks else blocks[-1]) * 2)
    steps = [round(at * (i + 1) / (len(blocks) + 1)) for i in range(len(blocks))]
    schedule.update(partial_delink_steps=steps, partial_delink_blocks=blocks)
    return f"k{k}-grow-at{at}", schedule


def sweep_groups(sweep: str, preset: dict, corpora: list[str], options: dict) -> list[dict]:
    """The groups of a sweep: one per (corpus, depth, schedule), each a scratch run and the P2R runs compared with
    it. schedule: k = L/4 and k = 1, delinked at a third of the run, and the growth 1 -> 2 -> 4 -> L; depth: the same
    two at each depth; growth: k = 1 delinked at each fraction of the run, once or growing."""
    total, groups = preset["total_steps"], []
    for corpus in corpora:
        for depth in options["depths"]:
            for scheduler in options["schedulers"]:
                runs = {"scratch": {"pseudo_steps": 0, "real_steps": total}}
                points = [max(1, min(total - 1, round(total * f / 5) * 5)) for f in options["fractions"]]
                for at in points:
                    quarter = max(1, depth // 4)
                    variants = {
                        "schedule": [(quarter, False)],
                        "depth": [(quarter, False), (1, False)],
                        # The delink point for k = L/4; growth from one block at a third of the run.
                        "growth": [(quarter, False)] + ([(1, True)] if abs(at - total / 3) <= 5 else []),
                        "best": [(quarter, False), (1, False), (1, True), (quarter, True)],
                    }[sweep]
                    for k, grow in variants:
                        name, schedule = p2r_schedule(total, at, k, depth, grow)
                        runs[name] = schedule
                        if sweep == "best":
                            # The same run with 1/1.5 of the steps and its own full schedule (delink at the same
                            # fraction): ending at or below scratch's final loss is the target met outright.
                            short = round(total / TARGET)
                            name, schedule = p2r_schedule(short, round(at * short / total), k, depth, grow)
                            runs[f"{name}-of{short}"] = schedule
                groups.append(
                    {
                        "name": f"{corpus}-L{depth}-{scheduler}",
                        "corpus": corpus,
                        "depth": depth,
                        "scheduler": scheduler,
                        "fields": {"num_hidden_layers": depth, "lr_scheduler": scheduler},
                        "runs": runs,
                    }
                )
    return groups


def _argv(fields: dict) -> list[str]:
    """Trainer flags of `fields` (a list value becomes several arguments of one flag)."""
    argv = []
    for key, value in fields.items():
        argv += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


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
        if code == 0:  # marks the run finished, for `_finished`
            output_dir = Path(argv[argv.index("--output_dir") + 1])
            _write_text(output_dir / "bench_argv.json", json.dumps(argv))
        return code == 0

    if jobs == 1:
        return all(done(task, _train_run(*task[3:], threads)) for task in tasks)
    # Spawned workers (not forked from a process holding torch's thread pools), each reused for many runs.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(_train_run, *task[3:], threads): task for task in tasks}
        for future in concurrent.futures.as_completed(futures):
            if not done(futures[future], future.result()):
                pool.shutdown(cancel_futures=True)
                return False
    return True


def _finished(output_dir: Path, argv: list[str]) -> bool:
    """Whether `output_dir` holds a finished run of exactly `argv` (its saved real model and the same arguments)."""
    marker = output_dir / "bench_argv.json"
    return (output_dir / "real").is_dir() and marker.is_file() and json.loads(marker.read_text()) == argv


def stage_times(records: list[dict], schedule: dict, depth: int) -> list[dict]:
    """[{blocks, steps, step_time_s}] per stage of a run, the step time measured from `train_time_s` (training only)."""
    k = schedule.get("num_unique_layers", depth) if schedule["pseudo_steps"] else depth
    bounds = [(0, k)]
    for step, blocks in zip(schedule.get("partial_delink_steps", []), schedule.get("partial_delink_blocks", [])):
        bounds.append((step, blocks))
    if schedule["pseudo_steps"]:
        bounds.append((schedule["pseudo_steps"], depth))
    end = schedule["pseudo_steps"] + schedule["real_steps"]
    curve = [(0, 0.0)] + sorted({r["step"]: r["train_time_s"] for r in records if "train_time_s" in r}.items())
    stages = []
    for (start, blocks), (stop, _) in zip(bounds, [*bounds[1:], (end, None)]):
        seconds = value_at(curve, stop) - value_at(curve, start)
        stages.append({"blocks": blocks, "steps": stop - start, "step_time_s": seconds / max(1, stop - start)})
    return stages


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


def run_sweep(sweep: str, args, preset: dict) -> dict:
    """Run every group of `sweep` for every seed; the result: per group, the runs' rows (aggregate over seeds, with
    stages: blocks, training-state bytes, step time) and the per-seed comparisons."""
    options = {**SWEEP_DEFAULTS[sweep]}
    for key in ("schedulers", "depths", "fractions"):
        if getattr(args, key):
            options[key] = getattr(args, key)
    workdir = Path(args.workdir) / "sweeps"  # shared by the sweeps: a group's runs are reused where they recur
    custom = "train_files" in preset["fields"] or "dataset_name" in preset["fields"]
    corpora = ["custom"] if custom else args.corpora
    groups = sweep_groups(sweep, preset, corpora, options)
    seeds, jobs = args.seeds or preset["seeds"], args.jobs or preset["jobs"]
    budgets = budget_runs(preset) if args.budgets else {}
    info = machine()
    info["torch_threads"] = args.threads
    started, tasks, reused = time.perf_counter(), [], 0
    for group in groups:
        corpus = {} if group["corpus"] == "custom" else corpus_fields(group["corpus"], preset, Path(args.workdir))
        group["fields"].update(corpus)
        group["seeds"] = seeds[: args.seeds_deep] if group["depth"] >= args.deep_depth else seeds
        if args.only:
            group["runs"] = {n: r for n, r in group["runs"].items() if n == "scratch" or n in args.only}
        for seed in group["seeds"]:
            for name, schedule in {**group["runs"], **budgets}.items():
                output_dir = workdir / group["name"] / f"seed{seed}" / name
                fields = {**preset["fields"], **group["fields"], **schedule, "seed": seed}
                fields.update(output_dir=str(output_dir), overwrite_output_dir=True)
                argv_run = _argv(fields)
                parse_config(argv_run)  # a bad --set fails here, before any run
                output_dir.parent.mkdir(parents=True, exist_ok=True)
                if _finished(output_dir, argv_run):
                    reused += 1  # the same run (fields, seed) in another sweep's group
                    continue
                steps = (schedule["pseudo_steps"] + schedule["real_steps"]) * group["depth"]
                log = str(output_dir.parent / f"{name}.log")
                tasks.append((steps, seed, f"{group['name']} {name}", argv_run, log))
    print(
        f"{sweep}: {len(tasks)} runs ({reused} reused) in {len(groups)} groups, {jobs} at a time; logs in {workdir}",
        flush=True,
    )
    loads = [info["load_average_at_start"][0]]
    if not run_tasks(tasks, jobs, args.threads, loads):
        raise RuntimeError(f"a run of the {sweep} sweep failed (see its log)")
    for group in groups:
        folder = workdir / group["name"]
        per_seed, stages = [], {name: [] for name in group["runs"]}
        for seed in group["seeds"]:
            records = {
                name: read_metrics(folder / f"seed{seed}" / name / "metrics.jsonl")
                for name in {**group["runs"], **budgets}
            }
            per_seed.append(compare_seed(seed, group["runs"], records, budgets))
            for name, schedule in group["runs"].items():
                stages[name].append(stage_times(records[name], schedule, group["depth"]))
        block, other = block_parameters(folder / f"seed{group['seeds'][0]}" / "scratch" / "real")
        group["parameters"] = {"block": block, "outside_blocks": other}
        group["rows"] = aggregate(per_seed)
        for row in group["rows"]:
            row["schedule"] = group["runs"][row["name"]]
            per_stage = zip(*stages[row["name"]])
            row["stages"] = [
                {
                    "blocks": runs[0]["blocks"],
                    "steps": runs[0]["steps"],
                    "state_bytes": STATE_BYTES_PER_PARAMETER * (other + runs[0]["blocks"] * block),
                    "step_time_s": statistics.fmean(r["step_time_s"] for r in runs),
                }
                for runs in per_stage
            ]
        group["per_seed"] = per_seed
    info["load_average_at_end"] = os.getloadavg()
    info["load_average_max"] = max(loads + [info["load_average_at_end"][0]])
    invocation = {
        "command": "python scripts/bench_convergence.py " + " ".join(args.argv),
        "machine": info,
        "jobs": jobs,
        "seed_list": seeds,
        "ran": len(tasks),
        "reused_runs": reused,
        "wall_time_s": time.perf_counter() - started,
    }
    return {"sweep": sweep, "preset": preset, "corpora": corpora, "invocations": [invocation], "groups": groups}


def _config_key(group: dict, row: dict) -> str:
    return f"L={group['depth']} {group['scheduler']} {row['name']}"


def _per_seed(row: dict) -> str:
    return ", ".join("not reached" if x is None else _times(x) for x in row["speedup_steps_per_seed"])


def _worst(row: dict) -> float:
    """The smallest speed-up over seeds (0 when a seed never reached scratch's final loss)."""
    return min((x or 0.0) for x in row["speedup_steps_per_seed"])


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def best_configurations(sweeps: dict[str, dict]) -> list[dict]:
    """Every P2R configuration (depth, schedule, run) measured on every corpus, best first by its smallest speed-up
    over corpora and seeds: {key, worst, by_corpus: {corpus: row}}."""
    table: dict[str, dict] = {}
    corpora = set()
    for result in sweeps.values():
        for group in result["groups"]:
            corpora.add(group["corpus"])
            for row in group["rows"][1:]:
                entry = table.setdefault(_config_key(group, row), {"by_corpus": {}, "seeds": {}})
                previous = entry["by_corpus"].get(group["corpus"])
                if previous is None or len(row["speedup_steps_per_seed"]) > len(previous["speedup_steps_per_seed"]):
                    entry["by_corpus"][group["corpus"]] = row
    out = []
    for key, entry in table.items():
        if set(entry["by_corpus"]) == corpora:
            rows = entry["by_corpus"].values()
            out.append({"key": key, "worst": min(_worst(r) for r in rows), "by_corpus": entry["by_corpus"]})
    return sorted(out, key=lambda e: -e["worst"])


def _group_table(result: dict) -> list[str]:
    lines = [
        "| corpus | L | schedule | run | delink at | final val loss | Δ vs scratch | gap at the delink | to scratch's "
        "final loss, per seed | mean (steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group in result["groups"]:
        for row in group["rows"]:
            gap = row.get("gaps", {}).get("at_delink")
            schedule = row["schedule"]
            at = "-"
            if schedule["pseudo_steps"]:
                grow = schedule.get("partial_delink_steps", [])
                at = " / ".join(str(s) for s in [*grow, schedule["pseudo_steps"]])
            lines.append(
                f"| {group['corpus']} | {group['depth']} | {group['scheduler']} | {row['name']} | {at} | "
                f"{row['final_val_loss_mean']:.4f} | "
                f"{row['delta_vs_scratch_mean']:+.4f} ± {row['delta_vs_scratch_sd']:.4f} | "
                f"{'-' if gap is None else format(gap['mean'], '+.4f')} | {_per_seed(row)} | "
                f"{_times(row['speedup_steps_mean'])} |"
            )
    return lines


def _stage_table(result: dict) -> list[str]:
    """Training-state bytes and measured step time per stage, one line per (group, P2R run) and scratch."""
    lines = [
        "| corpus | L | schedule | run | stages (blocks: steps) | training state per stage (MiB) | state / scratch's "
        "| step time per stage (ms) | scratch's step time (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group in result["groups"]:
        scratch = group["rows"][0]["stages"][0]
        for row in group["rows"][1:]:
            stages = row["stages"]
            lines.append(
                f"| {group['corpus']} | {group['depth']} | {group['scheduler']} | {row['name']} | "
                + ", ".join(f"{s['blocks']}: {s['steps']}" for s in stages)
                + " | "
                + " / ".join(_mb(s["state_bytes"]) for s in stages)
                + " | "
                + " / ".join(f"{s['state_bytes'] / scratch['state_bytes']:.2f}" for s in stages)
                + " | "
                + " / ".join(f"{1000 * s['step_time_s']:.0f}" for s in stages)
                + f" | {1000 * scratch['step_time_s']:.0f} |"
            )
    return lines


def _sweep_header(result: dict) -> list[str]:
    """One line per invocation that ran part of the sweep: machine, date, load, its command."""
    f = result["preset"]["fields"]
    lines = [
        f"{result['preset']['total_steps']} steps of {f['per_device_batch_size']} x {f['block_size']} tokens, hidden "
        f"{f['hidden_size']}; seeds per group: "
        + ", ".join(f"{g['name']} {g['seeds']}" for g in result["groups"])
        + ". Runs (a run recurring in another sweep's group is reused, not repeated):",
        "",
    ]
    for run in result["invocations"]:
        m = run["machine"]
        lines.append(
            f"- `{run['command']}`: {m['date']} on {m['cpu']} ({m['cpu_count']} cores, {run['jobs']} run(s) at a "
            f"time, {m['torch_threads']} torch thread(s) each, under `nice -n 10` beside other work), torch "
            f"{m['torch']}; {run['ran']} runs ({run['reused_runs']} reused) in {run['wall_time_s'] / 60:.1f} min; load "
            f"average (1 min) {m['load_average_at_start'][0]:.1f} at the start, {m['load_average_max']:.1f} at most, "
            f"{m['load_average_at_end'][0]:.1f} at the end (times are noisy above {m['cpu_count']}; steps are not)."
        )
    return lines


def merge_sweep(previous: dict | None, result: dict) -> dict:
    """`result` with the groups of `previous` (an earlier run of the same sweep) that it did not run again, and its
    invocations before this one: a sweep can be run in parts (e.g. --depths 32 later, with fewer seeds)."""
    if previous is None or previous.get("preset", {}).get("fields") != result["preset"]["fields"]:
        return result
    names = {g["name"] for g in result["groups"]}
    kept = [g for g in previous["groups"] if g["name"] not in names]
    order = {corpus: i for i, corpus in enumerate(CORPORA)}
    groups = sorted(kept + result["groups"], key=lambda g: (order.get(g["corpus"], 9), g["depth"], g["scheduler"]))
    corpora = list(dict.fromkeys([*previous["corpora"], *result["corpora"]]))
    return {
        **result,
        "corpora": corpora,
        "invocations": previous["invocations"] + result["invocations"],
        "groups": groups,
    }


def sweep_markdown(sweeps: dict[str, dict], plots: dict[str, str]) -> str:
    """convergence.md: findings first (from the numbers), then each sweep's tables."""
    any_result = next(iter(sweeps.values()))
    f, total = any_result["preset"]["fields"], any_result["preset"]["total_steps"]
    lines = [
        "# Convergence: when does Pseudo-to-Real pay off?",
        "",
        "Written by `scripts/bench_convergence.py --report` from the sweep files beside it "
        f"({', '.join(f'`convergence_{name}.json`' for name in sweeps)}); each sweep is run by "
        "`scripts/bench_convergence.py --sweep NAME` (commands under each table).",
        "",
        "**Measure.** A P2R run's speed-up is scratch's steps / the P2R run's steps to reach scratch's final "
        "validation loss (same corpus, depth, schedule, seed; linear interpolation between evaluations every "
        f"{f['eval_steps']} steps). Every run of a comparison has the same data order, token budget ({total} "
        f"optimizer steps of {f['per_device_batch_size']} x {f['block_size']} tokens), peak learning rate "
        f"({f['learning_rate']:g}) and schedule over the whole run; P2R runs train shared blocks at 1/n of the rate "
        "(`shared_lr_scale: depth`) and carry the optimizer state with `scale`. A pseudo step runs the full depth, "
        "so equal steps are equal compute. The sweeps give no speed-up in training time: a sweep reuses runs made by "
        "earlier invocations at other loads of a shared machine, so a time ratio between two runs would measure the "
        "load; the step time measured per stage (under each table, with its invocation's load) is what to read "
        "instead. kK-atD: K shared blocks, delinked to the real model at step D; "
        "kK-grow-atD: K blocks doubled at evenly spaced partial delinks (1 -> 2 -> 4 -> L), the last at step D. "
        f"Corpora: stdlib, {CORPORA['stdlib']}; prose, {CORPORA['prose']}.",
        "",
    ]
    lines += _findings(sweeps)
    if "convergence" in plots:
        lines += ["", f"![loss vs step]({plots['convergence']})"]
    if "depth" in plots:
        lines += ["", f"![speed-up vs L]({plots['depth']})"]
    for name, result in sweeps.items():
        lines += ["", f"## Sweep: {name}", "", *_sweep_header(result), ""]
        lines += _group_table(result)
        lines += [
            "",
            "Training state (fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter) and "
            "measured training time per step, per stage (mean over seeds):",
            "",
        ]
        lines += _stage_table(result)
    lines.append("")
    return "\n".join(lines)


def depth_series(sweeps: dict[str, dict]) -> dict[str, dict[str, list[tuple[int, dict]]]]:
    """{corpus: {"k=L/4" | "k=1": [(L, row)] by L}}: the depth sweep's runs (its schedule and delink step) in every
    sweep's groups, each (corpus, L, run) where it has the most seeds (the L = 8 runs may come from another sweep)."""
    depth = sweeps["depth"]
    scheduler, names = depth["groups"][0]["scheduler"], {r["name"] for g in depth["groups"] for r in g["rows"][1:]}
    at = {name.partition("-at")[2] for name in names}
    best: dict[tuple[str, int, str], dict] = {}
    for result in sweeps.values():
        for group in result["groups"]:
            if group["scheduler"] != scheduler:
                continue
            for row in group["rows"][1:]:
                kind = _kind(row["name"], group["depth"])
                if kind not in ("k=L/4", "k=1") or row["name"].partition("-at")[2] not in at:
                    continue
                key = (group["corpus"], group["depth"], kind)
                if key not in best or len(row["speedup_steps_per_seed"]) > len(best[key]["speedup_steps_per_seed"]):
                    best[key] = row
    series: dict[str, dict[str, list[tuple[int, dict]]]] = {}
    for (corpus, size, kind), row in sorted(best.items(), key=lambda item: item[0][1]):
        series.setdefault(corpus, {}).setdefault(kind, []).append((size, row))
    return series


def _rows_by(result: dict) -> dict[tuple[str, int, str], dict[str, dict]]:
    """{(corpus, depth, scheduler): {run name: row}} of a sweep."""
    return {(g["corpus"], g["depth"], g["scheduler"]): {r["name"]: r for r in g["rows"]} for g in result["groups"]}


def _kind(name: str, depth: int) -> str:
    """A run's name without its k and delink step when k = L/4 (k=L/4-atD) or k = 1."""
    k, _, rest = name.partition("-")
    label = "k=1" if k == "k1" else "k=L/4" if k == f"k{max(1, depth // 4)}" else k
    return f"{label}-{rest.split('-at')[0]}" if "grow" in rest else label


def _findings(sweeps: dict[str, dict]) -> list[str]:
    lines = ["## Findings", ""]
    best = best_configurations(sweeps)
    if best:
        top = best[0]
        per = "; ".join(
            f"{corpus}: {_per_seed(row)} (mean {_times(row['speedup_steps_mean'])})"
            for corpus, row in sorted(top["by_corpus"].items())
        )
        met = "meets" if top["worst"] >= TARGET else f"does not meet (worst seed {_times(top['worst'])})"
        lines.append(
            f"- **Which configuration to pick**: {top['key']}, the best by its worst seed over every corpus: {per} "
            f"fewer steps than scratch to scratch's final loss. It {met} the {TARGET}x target on every corpus and seed."
        )
        runners = [f"{e['key']} (worst seed {_times(e['worst'])})" for e in best[1:4]]
        if runners:
            lines.append(f"  Next: {', '.join(runners)}.")
    if "schedule" in sweeps:
        rows = _rows_by(sweeps["schedule"])
        parts = []
        for corpus in sweeps["schedule"]["corpora"]:
            depth = min(g["depth"] for g in sweeps["schedule"]["groups"])
            cosine, wsd = rows.get((corpus, depth, "cosine")), rows.get((corpus, depth, "wsd"))
            if not cosine or not wsd:
                continue
            names = [n for n in cosine if n != "scratch"]
            pairs = ", ".join(
                f"{n} {_times(cosine[n]['speedup_steps_mean'])} → {_times(wsd[n]['speedup_steps_mean'])}" for n in names
            )
            parts.append(
                f"{corpus} (L={depth}; scratch ends at {cosine['scratch']['final_val_loss_mean']:.3f} with cosine, "
                f"{wsd['scratch']['final_val_loss_mean']:.3f} with WSD): {pairs}"
            )
        if parts:
            lines.append("- **Schedule** (mean speed-up, cosine → WSD): " + "; ".join(parts) + ".")
    if "depth" in sweeps:
        parts = []
        for corpus, kinds in depth_series(sweeps).items():
            cells = [
                f"{kind} "
                + ", ".join(
                    f"L={size} {_times(row['speedup_steps_mean'])} ({len(row['speedup_steps_per_seed'])} seed(s), "
                    + ("some never reach scratch's final loss)" if not _worst(row) else f"worst {_times(_worst(row))})")
                    for size, row in points
                )
                for kind, points in kinds.items()
            ]
            parts.append(f"{corpus}: " + "; ".join(cells))
        measured = {size for kinds in depth_series(sweeps).values() for points in kinds.values() for size, _ in points}
        missing = [size for size in SWEEP_DEFAULTS["depth"]["depths"] if size not in measured]
        lines.append(
            f"- **Depth** (mean speed-up, {sweeps['depth']['groups'][0]['scheduler']}, delink at a third of the run, "
            "same width and tokens): "
            + "; ".join(parts)
            + "."
            + (f" Not measured: L = {', '.join(map(str, missing))} (not run)." if missing else "")
        )
    if "growth" in sweeps:
        rows = _rows_by(sweeps["growth"])
        parts = []
        for (corpus, depth, scheduler), runs in rows.items():
            cells = ", ".join(
                f"{name} {_times(row['speedup_steps_mean'])}" for name, row in runs.items() if name != "scratch"
            )
            parts.append(f"{corpus} (L={depth}, {scheduler}): {cells}")
        lines.append("- **Growth and delink point** (mean speed-up): " + "; ".join(parts) + ".")
    lines += _why(sweeps)
    losing = sorted(
        {
            f"{_config_key(g, r)} on {g['corpus']} ({_per_seed(r)})"
            for result in sweeps.values()
            for g in result["groups"]
            for r in g["rows"][1:]
            if _worst(r) < 1.1
        }
    )
    if losing:
        lines.append(
            "- **Where P2R does not pay** (some seed below 1.1x, or never at scratch's final loss): "
            + "; ".join(losing)
            + "."
        )
    if "depth" in sweeps:
        parts = []
        for group in sweeps["depth"]["groups"]:
            if group["corpus"] != sweeps["depth"]["corpora"][0]:
                continue
            scratch = group["rows"][0]["stages"][0]
            for row in group["rows"][1:]:
                pseudo = row["stages"][0]
                parts.append(
                    f"L={group['depth']} {row['name']}: {_mb(pseudo['state_bytes'])} / "
                    f"{_mb(scratch['state_bytes'])} MiB ({pseudo['state_bytes'] / scratch['state_bytes']:.2f}), step "
                    f"{1000 * pseudo['step_time_s']:.0f} / "
                    f"{1000 * row['stages'][-1]['step_time_s']:.0f} ms"
                )
        lines.append(
            "- **Under a fixed memory budget**: training state of the pseudo / real model (fp32 weights, gradients, "
            "AdamW moments) and step time pseudo / real stage, measured on this CPU: "
            + "; ".join(parts)
            + ". A pseudo step costs what a real step costs (same depth, same FLOPs), so where the real model needs "
            "offload and the pseudo model does not, the pseudo stage runs at the device's full speed while the real "
            "model pays offload's slowdown s on every step: scratch takes T·s, P2R D + (N − D)·s step-times (T "
            "scratch's steps, N P2R's steps to scratch's final loss, D its pseudo steps)."
            + (_offload_gain(best[0]) if best else "")
        )
    return lines


def offload_gain(total: float, steps: float, pseudo: float, slowdown: float) -> float:
    """Wall-clock speed-up to scratch's final loss when every real-model step is `slowdown` times slower (offload)
    and the pseudo model's `pseudo` steps are not: scratch's `total` steps against P2R's `steps`."""
    real = max(0.0, steps - pseudo)
    return total * slowdown / (min(steps, pseudo) + real * slowdown)


def _offload_gain(entry: dict) -> str:
    cells = []
    for corpus, row in sorted(entry["by_corpus"].items()):
        if row["speedup_steps_mean"] is None:
            continue
        total = row["schedule"]["pseudo_steps"] + row["schedule"]["real_steps"]
        steps = total / row["speedup_steps_mean"]
        gains = ", ".join(
            f"{offload_gain(total, steps, row['schedule']['pseudo_steps'], s):.2f}x at s = {s}" for s in (1, 2, 4)
        )
        cells.append(f"{corpus} {gains}")
    return f" For {entry['key']}: " + "; ".join(cells) + "." if cells else ""


def _lead(group: dict, index: int, at: float) -> tuple[float, float]:
    """(scratch's descent from step `at` to its end, the P2R run `index`'s lead over scratch at `at`), mean over seeds.

    A run reaches scratch's final loss by step `at` exactly when its lead there is at least scratch's descent."""
    descent, lead = [], []
    for seed in group["per_seed"]:
        scratch, run = seed["runs"][0]["val_curve"], seed["runs"][index]["val_curve"]
        descent.append(value_at(scratch, at) - scratch[-1][1])
        lead.append(value_at(scratch, at) - value_at(run, at))
    return statistics.fmean(descent), statistics.fmean(lead)


def widest_groups(sweeps: dict[str, dict]) -> list[dict]:
    """Each group once, where it has the most seeds (then runs): groups recur across sweeps."""
    widest: dict[str, dict] = {}
    for result in sweeps.values():
        for group in result["groups"]:
            size = (len(group["seeds"]), len(group["rows"]))
            name = group["name"]
            if name not in widest or size > (len(widest[name]["seeds"]), len(widest[name]["rows"])):
                widest[name] = group
    order = {corpus: i for i, corpus in enumerate(CORPORA)}
    return sorted(widest.values(), key=lambda g: (order.get(g["corpus"], 9), g["depth"], g["scheduler"]))


def _why(sweeps: dict[str, dict]) -> list[str]:
    """Per group, its best P2R run's lead over scratch at T / 1.5 against what 1.5x needs there."""
    parts = []
    for group in widest_groups(sweeps):
        scored = [
            (i, r)
            for i, r in enumerate(group["rows"])
            if i
            and r["schedule"]["real_steps"] + r["schedule"]["pseudo_steps"]
            == group["rows"][0]["schedule"]["real_steps"]
        ]
        if not scored:
            continue
        index, row = max(scored, key=lambda item: _worst(item[1]))
        at = group["rows"][0]["schedule"]["real_steps"] / TARGET
        descent, lead = _lead(group, index, at)
        parts.append(
            f"{group['name']} {row['name']}: needs {descent:.3f}, has {lead:+.3f} (final Δ "
            f"{row['delta_vs_scratch_mean']:+.3f})"
        )
    if not parts:
        return []
    return [
        "- **Why the speed-up stays where it is**: 1.5x means reaching scratch's final loss at 1/1.5 of the steps, "
        "i.e. being ahead of scratch there by as much as scratch still descends until its end (most of it in the "
        "schedule's final anneal, which both runs share). Scratch's remaining descent from step T/1.5 (needs) against "
        "the best P2R run's lead at that step (has), mean over seeds: " + "; ".join(parts) + "."
    ]


def plot_sweeps(sweeps: dict[str, dict], out: Path) -> dict[str, str]:
    """convergence.png (validation loss vs step, per group of every sweep) and
    convergence_depth.png (speed-up vs L); {name: file} of those written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    written = {}
    groups = widest_groups(sweeps)
    corpora = list(dict.fromkeys(g["corpus"] for g in groups))
    columns = max(sum(g["corpus"] == c for g in groups) for c in corpora)
    figure, axes = plt.subplots(len(corpora), columns, figsize=(5.5 * columns, 4.2 * len(corpora)), squeeze=False)
    for row_index, corpus in enumerate(corpora):
        for column, group in enumerate(g for g in groups if g["corpus"] == corpus):
            ax = axes[row_index][column]
            for index, row in enumerate(group["rows"]):
                curves = [seed["runs"][index]["val_curve"] for seed in group["per_seed"]]
                xs, mean, low, high = _band(curves)
                color = "black" if index == 0 else plt.cm.tab10(index - 1)
                ax.plot(xs, mean, color=color, linewidth=2 if index == 0 else 1.2, label=row["name"])
                ax.fill_between(xs, low, high, color=color, alpha=0.15, linewidth=0)
            target = statistics.fmean(seed["target"] for seed in group["per_seed"])
            ax.axhline(target, color="gray", linestyle=":", linewidth=1)
            ax.set_ylim(target - 0.4, target + 1.2)
            ax.set_title(f"{group['name']} ({len(group['per_seed'])} seed(s))")
            ax.set_xlabel("optimizer steps")
            ax.set_ylabel("validation loss (nats/token)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    figure.suptitle("Validation loss vs step, mean over seeds (band: min to max); dotted: scratch's final loss")
    figure.tight_layout()
    figure.savefig(out / "convergence.png", dpi=90)
    plt.close(figure)
    written["convergence"] = "convergence.png"
    if "depth" in sweeps:
        figure, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.5), squeeze=False)
        by_corpus = depth_series(sweeps)
        for ax, corpus in zip(axes[0], corpora):
            series = {
                kind: [(size, row["speedup_steps_per_seed"]) for size, row in points]
                for kind, points in by_corpus.get(corpus, {}).items()
            }
            for index, (kind, points) in enumerate(series.items()):
                color = plt.cm.tab10(index)
                reached = [(d, v) for d, v in points if None not in v]
                ax.plot(
                    [d for d, _ in reached],
                    [statistics.fmean(v) for _, v in reached],
                    marker="o",
                    color=color,
                    label=kind,
                )
                for depth, values in points:
                    ax.scatter([depth] * len(values), [x or 1.0 for x in values], color=color, s=12, alpha=0.5)
                    never = sum(x is None for x in values)
                    if never:  # a seed that never reaches scratch's final loss: an x on the no-gain line
                        ax.scatter([depth] * never, [1.0] * never, color=color, marker="x", s=60)
            ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            depths = sorted({size for points in series.values() for size, _ in points})
            ax.set_xticks(depths, [str(d) for d in depths])
            ax.minorticks_off()
            ax.set_xlabel("depth L (same width, same tokens)")
            ax.set_ylabel("speed-up to scratch's final loss (steps)")
            ax.set_title(corpus)
            ax.grid(alpha=0.3)
            if series:
                ax.legend()
        figure.suptitle(
            "Speed-up vs depth: mean (line) and seeds (dots); dashed: the 1.5x target; x: a seed that never reaches "
            "scratch's final loss"
        )
        figure.tight_layout()
        figure.savefig(out / "convergence_depth.png", dpi=90)
        plt.close(figure)
        written["depth"] = "convergence_depth.png"
    return written


def write_sweep_report(out: Path) -> Path:
    """convergence.md and its plots from every convergence_<sweep>.json in `out` (temp files, then renamed)."""
    sweeps = {}
    for name in SWEEPS:
        path = out / f"convergence_{name}.json"
        if path.is_file():
            sweeps[name] = json.loads(path.read_text(encoding="utf-8"))
    if not sweeps:
        raise FileNotFoundError(f"--report: no convergence_<sweep>.json in {out}; run --sweep first")
    plots = plot_sweeps(sweeps, out)
    _write_text(out / "convergence.md", sweep_markdown(sweeps, plots))
    return out / "convergence.md"


def _write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


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
    parser.add_argument("--sweep", choices=SWEEPS, help="run one sweep of issue 13, write convergence_SWEEP.json")
    parser.add_argument("--report", action="store_true", help="build convergence.md from the sweep files in --out")
    parser.add_argument("--corpora", nargs="+", choices=sorted(CORPORA), default=list(CORPORA), help="sweep corpora")
    parser.add_argument("--schedulers", nargs="+", help="sweep: learning-rate schedules (default: the sweep's)")
    parser.add_argument("--depths", type=int, nargs="+", help="sweep: depths L (default: the sweep's)")
    parser.add_argument("--fractions", type=float, nargs="+", help="sweep: delink points, fractions of the run")
    parser.add_argument("--seeds-deep", type=int, default=1, help="sweep: seeds at L >= --deep-depth (default 1)")
    parser.add_argument(
        "--deep-depth", type=int, default=32, help="sweep: see --seeds-deep (default 32: 4x L=8's cost)"
    )
    parser.add_argument("--only", nargs="+", help="sweep: only these P2R runs (and scratch), e.g. k1-grow-at100")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.report:
        print(f"wrote {write_sweep_report(Path(args.out))}")
        return 0
    preset = scaled(PRESETS[args.preset], args.steps, dict(args.set))
    if args.budgets is not None:
        preset["budgets"] = args.budgets
    if args.sweep:
        result = run_sweep(args.sweep, args, preset)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"convergence_{args.sweep}.json"
        result = merge_sweep(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None, result)
        _write_text(out / f"convergence_{args.sweep}.json", json.dumps(result, indent=2) + "\n")
        print(f"wrote {out / f'convergence_{args.sweep}.json'}; {write_sweep_report(out)}")
        return 0
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
