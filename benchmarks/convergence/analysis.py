"""The convergence benchmarks' arithmetic on validation curves (no training): where a curve reaches a loss, the two
speed-ups of a P2R run against its seed's scratch run, where its gap arises, and the summary over seeds."""

import math
import statistics


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


def offload_gain(total: float, steps: float, pseudo: float, slowdown: float) -> float:
    """Wall-clock speed-up to scratch's final loss when every real-model step is `slowdown` times slower (offload)
    and the pseudo model's `pseudo` steps are not: scratch's `total` steps against P2R's `steps`."""
    real = max(0.0, steps - pseudo)
    return total * slowdown / (min(steps, pseudo) + real * slowdown)


def band(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x (mean over seeds), and the mean, minimum and maximum of y, over curves sampled at the same points."""
    columns = list(zip(*curves))
    xs = [statistics.fmean(x for x, _ in column) for column in columns]
    ys = [[y for _, y in column] for column in columns]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]
