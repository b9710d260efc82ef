"""The sweeps' page, convergence.md: findings first (from the numbers), then each sweep's tables, and its plots
(convergence.png: validation loss vs step per group; convergence_depth.png: speed-up vs depth)."""

import json
import statistics
from pathlib import Path

from benchmarks.convergence.analysis import band, offload_gain, value_at
from benchmarks.convergence.report import times
from benchmarks.convergence.sweeps import CORPORA, SWEEP_DEFAULTS, SWEEP_OPTIMIZERS, SWEEPS, TARGET, group_order
from benchmarks.harness import pyplot, save_figure, write_text


def _config_key(group: dict, row: dict) -> str:
    return f"L={group['depth']} {group['scheduler']} {row['name']}"


def _per_seed(row: dict) -> str:
    return ", ".join("not reached" if x is None else times(x) for x in row["speedup_steps_per_seed"])


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


def _run_table(result: dict, columns: str, cells, scratch: bool) -> list[str]:
    """A table of `result`'s runs, a line per (group, run; scratch's too with `scratch`): its corpus, L, schedule and
    name, then `columns` (their titles, `|`-separated), whose cells `cells(group, row)` gives."""
    lines = [f"| corpus | L | schedule | run | {columns} |", "|---" * (5 + columns.count("|")) + "|"]
    for group in result["groups"]:
        for row in group["rows"][0 if scratch else 1 :]:
            schedule = group["scheduler"] + (f", {group['optimizer']}" if group.get("optimizer") else "")
            head = f"| {group['corpus']} | {group['depth']} | {schedule} | {row['name']} | "
            lines.append(head + " | ".join(cells(group, row)) + " |")
    return lines


def _group_table(result: dict) -> list[str]:
    """Each run's final loss, its difference to scratch's, its gap at the delink and its speed-up."""

    def cells(group: dict, row: dict) -> list[str]:
        gap = row.get("gaps", {}).get("at_delink")
        schedule = row["schedule"]
        at = "-"
        if schedule["pseudo_steps"]:
            grow = schedule.get("partial_delink_steps", [])
            at = " / ".join(str(s) for s in [*grow, schedule["pseudo_steps"]])
        return [
            at,
            f"{row['final_val_loss_mean']:.4f}",
            f"{row['delta_vs_scratch_mean']:+.4f} ± {row['delta_vs_scratch_sd']:.4f}",
            "-" if gap is None else format(gap["mean"], "+.4f"),
            _per_seed(row),
            times(row["speedup_steps_mean"]),
        ]

    columns = (
        "delink at | final val loss | Δ vs scratch | gap at the delink | to scratch's final loss, per seed | "
        "mean (steps)"
    )
    return _run_table(result, columns, cells, scratch=True)


def _stage_table(result: dict) -> list[str]:
    """Training-state bytes and measured step time per stage, one line per (group, P2R run) and scratch."""

    def cells(group: dict, row: dict) -> list[str]:
        scratch, stages = group["rows"][0]["stages"][0], row["stages"]
        return [
            ", ".join(f"{s['blocks']}: {s['steps']}" for s in stages),
            " / ".join(_mb(s["state_bytes"]) for s in stages),
            " / ".join(f"{s['state_bytes'] / scratch['state_bytes']:.2f}" for s in stages),
            " / ".join(f"{1000 * s['step_time_s']:.0f}" for s in stages),
            f"{1000 * scratch['step_time_s']:.0f}",
        ]

    columns = (
        "stages (blocks: steps) | training state per stage (MiB) | state / scratch's | step time per stage (ms) | "
        "scratch's step time (ms)"
    )
    return _run_table(result, columns, cells, scratch=False)


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
    adamw = {name: result for name, result in sweeps.items() if name not in SWEEP_OPTIMIZERS}
    lines += _findings(adamw)
    lines += _muon_findings(sweeps)
    if "convergence" in plots:
        lines += ["", f"![loss vs step]({plots['convergence']})"]
    if "depth" in plots:
        lines += ["", f"![speed-up vs L]({plots['depth']})"]
    for name, result in sweeps.items():
        lines += ["", f"## Sweep: {name}", "", *_sweep_header(result), ""]
        if name in SWEEP_OPTIMIZERS:
            optimizers = ", ".join(SWEEP_OPTIMIZERS[name])
            lines += [f"Each group runs under the optimizer its name ends with ({optimizers}).", ""]
        lines += _group_table(result)
        if name in SWEEP_OPTIMIZERS:
            continue  # the stage table sizes AdamW's state
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
            f"{corpus}: {_per_seed(row)} (mean {times(row['speedup_steps_mean'])})"
            for corpus, row in sorted(top["by_corpus"].items())
        )
        met = "meets" if top["worst"] >= TARGET else f"does not meet (worst seed {times(top['worst'])})"
        lines.append(
            f"- **Which configuration to pick**: {top['key']}, the best by its worst seed over every corpus: {per} "
            f"fewer steps than scratch to scratch's final loss. It {met} the {TARGET}x target on every corpus and seed."
        )
        runners = [f"{e['key']} (worst seed {times(e['worst'])})" for e in best[1:4]]
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
                f"{n} {times(cosine[n]['speedup_steps_mean'])} → {times(wsd[n]['speedup_steps_mean'])}" for n in names
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
                    f"L={size} {times(row['speedup_steps_mean'])} ({len(row['speedup_steps_per_seed'])} seed(s), "
                    + ("some never reach scratch's final loss)" if not _worst(row) else f"worst {times(_worst(row))})")
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
                f"{name} {times(row['speedup_steps_mean'])}" for name, row in runs.items() if name != "scratch"
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


def _spread(row: dict) -> tuple[float, float]:
    values = [x or 0.0 for x in row["speedup_steps_per_seed"]]
    return min(values), max(values)


def _muon_findings(sweeps: dict[str, dict]) -> list[str]:
    """P2R's speed-up under Muon against the same configuration under AdamW, per corpus, from the muon sweep (both
    optimizers run together); each P2R run against scratch with its own optimizer."""
    if "muon" not in sweeps:
        return []
    by_key: dict[tuple, dict[str, dict]] = {}
    for group in sweeps["muon"]["groups"]:
        key = (group["corpus"], group["depth"], group["scheduler"])
        by_key.setdefault(key, {})[group.get("optimizer", "adamw")] = group
    parts, verdicts = [], []
    for (corpus, depth, scheduler), pair in by_key.items():
        if set(pair) != {"adamw", "muon"}:
            continue
        muon, adamw = ({r["name"]: r for r in pair[o]["rows"]} for o in ("muon", "adamw"))
        for name, row in muon.items():
            if name == "scratch" or name not in adamw:
                continue
            other = adamw[name]
            low, high = _spread(row)
            other_low, other_high = _spread(other)
            verdict = "grows" if low > other_high else "shrinks" if high < other_low else "holds (the seeds overlap)"
            if not high and not other_high:
                verdict = "no speed-up under either (scratch's final loss not reached)"
            verdicts.append(f"{corpus} {verdict}")
            parts.append(
                f"{corpus} (L={depth}, {scheduler}, {name}): Muon {_per_seed(row)} (mean "
                f"{times(row['speedup_steps_mean'])}; scratch ends at {muon['scratch']['final_val_loss_mean']:.3f}, "
                f"P2R at {row['final_val_loss_mean']:.3f}) against AdamW {_per_seed(other)} (mean "
                f"{times(other['speedup_steps_mean'])}; scratch {adamw['scratch']['final_val_loss_mean']:.3f}, "
                f"P2R {other['final_val_loss_mean']:.3f})"
            )
    if not parts:
        return []
    seeds = sorted({s for g in sweeps["muon"]["groups"] for s in g["seeds"]})
    return [
        "- **Under Muon** (`optimizer: muon`: Muon for the blocks' matrices, AdamW elsewhere, the same peak rate, "
        f"untuned; the muon sweep runs both optimizers together, seeds {', '.join(map(str, seeds))}; each P2R run "
        "against scratch with the same optimizer): speed-up in steps to scratch's final loss, per seed: "
        + "; ".join(parts)
        + ". P2R's speed-up under Muon against AdamW's: "
        + ", ".join(verdicts)
        + "."
    ]


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
    return sorted(widest.values(), key=group_order)


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
    plt = pyplot()
    if plt is None or not sweeps:
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
                xs, mean, low, high = band(curves)
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
    save_figure(figure, out / "convergence.png", dpi=90)
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
        save_figure(figure, out / "convergence_depth.png", dpi=90)
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
    plots = plot_sweeps({name: result for name, result in sweeps.items() if name not in SWEEP_OPTIMIZERS}, out)
    write_text(out / "convergence.md", sweep_markdown(sweeps, plots))
    return out / "convergence.md"
