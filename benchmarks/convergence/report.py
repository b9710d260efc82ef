"""The convergence study's page (convergence_carry.md, and moe_convergence.md built on it): the runs of each seed
against scratch, both speed-ups, the verdict against the target, where the gap arises, and the curves (PNG)."""

import statistics
from pathlib import Path

from benchmarks.convergence.analysis import band, value_at
from benchmarks.convergence.runs import SAME_LR
from benchmarks.harness import pyplot, save_figure, write_json, write_text


def report_stem(preset: str) -> str:
    """convergence_carry.* (the optimizer-carry study at L = 8) for the CPU preset: convergence.* is the sweep page."""
    return "convergence_carry" if preset == "cpu" else f"convergence_{preset}"


def write_report(result: dict, out: Path) -> None:
    """convergence_carry.{json,md,png} for the CPU preset, convergence_<preset>.* for the others."""
    stem = report_stem(result["preset_name"])
    write_json(out / f"{stem}.json", result)
    write_text(out / f"{stem}.md", markdown(result))
    if not plot(result, out / f"{stem}.png"):
        print(f"matplotlib is not installed: skipped {stem}.png")


def times(value: float | None, bound: str = "=") -> str:
    """A speed-up as the pages print it: `1.50x`, `≤0.50x` or `>1.50x` for a bound, `-` for none."""
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
        per_seed = ", ".join("not reached" if x is None else times(x) for x in row["speedup_steps_per_seed"])
        equal = ", ".join(times(x, bound) for x, bound in row["speedup_equal_loss_per_seed"])
        equal_mean = row["speedup_equal_loss_mean"]
        lines.append(
            f"| {row['name']} | {row['pseudo_steps'] or '-'} | {row['final_val_loss_mean']:.4f} | "
            f"{row['delta_vs_scratch_mean']:+.4f} ± {row['delta_vs_scratch_sd']:.4f} | {per_seed} | "
            f"{times(row['speedup_steps_mean'])} | {times(row['speedup_time_mean'])} | {equal} | "
            f"{times(*equal_mean) if equal_mean else '-'} |"
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
            f"At equal final loss, the best is {best_equal['name']} at {times(value, bound)} (mean over seeds): {met}."
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


def plot(result: dict, path: Path) -> bool:
    """The curves of every run (mean over seeds, band from min to max) into `path`; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    seeds = result["seeds"]
    names = [run["name"] for run in seeds[0]["runs"]]
    palette = [plt.cm.tab10(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]  # no gray: scratch's band is gray
    colors = {name: "black" if i == 0 else palette[(i - 1) % len(palette)] for i, name in enumerate(names)}
    figure, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    (by_step, by_real, by_time), (by_gap, by_budget, legend) = axes

    def draw(ax, curves, name, **style):
        xs, mean, low, high = band(curves)
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
    save_figure(figure, path, dpi=100)
    return True
