"""Compute to loss (issue 39): does growing the model in depth make pretraining cost less?

Every run of a group (corpus x optimizer x seed) spends the same training FLOPs as the group's scratch run: a recipe
whose early steps run a shallower model takes more steps (and tokens) for the same compute; in pretraining data is
plentiful and compute is the cost. The measure is scratch's FLOPs / the run's FLOPs to reach scratch's final validation
loss (crossing found by linear interpolation on the run's (FLOPs, validation loss) curve), with tokens, steps and the
final losses beside it. The equal-token comparison is reported too: the run's validation loss where it has seen as
many tokens as scratch in all, and, for the recipes with a `-tok` variant, a run of scratch's steps with its own full
schedule.

FLOPs are the trainer's own: every `metrics.jsonl` record carries the run's cumulative `flops` and `tokens`
(`inventory(config).flops(seq_len)` of the model each step ran: forward + backward, attention and head included), so
the benchmark reads what the trainer counted. The equal-compute step counts are solved with the same formula.

    python scripts/bench_convergence.py --compute                  # every recipe, both corpora, AdamW and Muon, 3 seeds
    python scripts/bench_convergence.py --compute --seeds 0 --only p2r-1-2-4-8 bu-1to8-at80   # a subset
    python scripts/bench_convergence.py --compute --report          # the page from the runs finished so far

Runs go to --workdir/compute/GROUP/seedS/NAME (a finished run with the same arguments is reused, so a study runs in
parts); the page and its JSON (benchmarks/convergence_compute.{md,json}) are built from every finished run there and say
what was run and what was not.
"""

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.convergence.analysis import crossing, value_at
from benchmarks.convergence.runs import finished, load_at_end, machine, output_dir_of, run_tasks, scaled, trainer_argv
from benchmarks.convergence.sweeps import CORPORA, corpus_fields
from benchmarks.harness import write_json, write_text
from hf_p2r.training.metrics import read_metrics

TARGET = 2.0  # the issue's: >= 2x less compute to scratch's final loss, at every seed
OPTIMIZERS = ("adamw", "muon")
STEM = "convergence_compute"
# Every run of the study, scratch included: warm-up, stable, decay (Bu's schedule); its decay is the last fifth.
STUDY_FIELDS = {"lr_scheduler": "wsd", "shared_lr_scale": "depth"}


@dataclass(frozen=True)
class Recipe:
    """A training recipe: its stages as (first step as a fraction of the run's steps, depth d, blocks k), the first at
    0 and the last the real model (L, L), and the trainer fields it sets (growth, carry, function preservation,
    depth-µP). `equal_tokens`: it runs scratch's steps (not scratch's FLOPs). `budget`: the share of scratch's FLOPs
    it spends (below 1, its schedule, decay included, is compressed into that share: its best loss comes earlier)."""

    name: str
    what: str
    stages: tuple[tuple[float, int, int], ...]
    fields: dict = field(default_factory=dict)
    equal_tokens: bool = False
    budget: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.budget <= 1.0 or (self.equal_tokens and self.budget != 1.0):
            raise ValueError(
                f"recipe {self.name}: budget {self.budget} is not in (0, 1] or is set on an equal-token run"
            )


def doubling(start: float, end: float, depth: int, first: int = 1) -> list[tuple[float, int, int]]:
    """Stages of a shared model of `depth` layers from `first` blocks doubling up to depth (exclusive), evenly spaced
    in [start, end) of the run."""
    blocks = [first]
    while blocks[-1] * 2 < depth:
        blocks.append(blocks[-1] * 2)
    return [(start + (end - start) * i / len(blocks), depth, k) for i, k in enumerate(blocks)]


def recipes(depth: int) -> dict[str, Recipe]:
    """The study's recipes for a real model of `depth` layers, in the page's order (scratch first)."""
    L, quarter, half = depth, max(1, depth // 4), max(1, depth // 2)
    real = (L, L)
    growth = {"optimizer_carry": "reset", "growth": "stack"}  # the calibrating probe's (the issue's): reset
    out = [
        Recipe("scratch", "the real model from step 0", ((0.0, *real),)),
        Recipe(
            "p2r-1-2-4-8",
            f"today's best P2R: full depth, 1 -> 2 -> 4 -> {L} blocks, real at a third (scale carry)",
            (*doubling(0.0, 1 / 3, L), (1 / 3, *real)),
            {"optimizer_carry": "scale"},
        ),
    ]
    for percent in (60, 70, 80, 90):
        out.append(
            Recipe(
                f"bu-1to{L}-at{percent}",
                f"Bu (arXiv 2511.04981): one layer, grown once to {L} at {percent}% of the steps",
                ((0.0, 1, 1), (percent / 100, *real)),
                growth,
            )
        )
    out.append(
        Recipe(
            f"gstack-{quarter}to{L}-at50",
            f"G_stack (arXiv 2405.15319): {quarter} layers (L/4), stacked to {L} at half the steps",
            ((0.0, quarter, quarter), (0.5, *real)),
            growth,
        )
    )
    out.append(
        Recipe(
            f"hybrid-{half}x1-at50",
            f"shallow and shared: {half} layers sharing 1 -> {half} blocks, stacked to {L} at half the steps",
            (*doubling(0.0, 0.5, half), (0.5, *real)) if half > 1 else ((0.0, 1, 1), (0.5, *real)),
            growth,
        )
    )
    base = out[-2]  # G_stack: the variants
    out += [
        Recipe(
            f"{base.name}-fp", base.what + ", function-preserving", base.stages, {**growth, "function_preserving": True}
        ),
        Recipe(f"{base.name}-mup", base.what + ", depth-µP", base.stages, {**growth, "depth_mup": True}),
        Recipe(f"{base.name}-tok", base.what + ", scratch's steps (equal tokens)", base.stages, growth, True),
        Recipe(
            f"bu-1to{L}-at80-tok",
            "Bu, grown at 80%, scratch's steps (equal tokens)",
            ((0.0, 1, 1), (0.8, *real)),
            growth,
            True,
        ),
    ]
    # a budget below scratch's FLOPs: the whole schedule (growth and WSD decay) in that share, so the decay, and the
    # loss it brings, comes earlier; reaching scratch's final loss is then a speed-up of 1 / budget or more (b50: 2x)
    by_name = {recipe.name: recipe for recipe in out}
    for name, budgets in (
        ("scratch", (50, 70)),
        (f"bu-1to{L}-at80", (50, 60, 70)),
        (f"bu-1to{L}-at60", (50,)),
        (f"gstack-{quarter}to{L}-at50", (50,)),
    ):
        base = by_name[name]
        out += [
            Recipe(f"{name}-b{b}", f"{base.what}, {b}% of scratch's FLOPs", base.stages, base.fields, budget=b / 100)
            for b in budgets
        ]
    return {recipe.name: recipe for recipe in out}


def solve_steps(recipe: Recipe, scratch_steps: int, flops_per_token) -> int:
    """The run's steps: scratch's for `equal_tokens`, else those that spend `recipe.budget` of scratch's FLOPs
    (`flops_per_token(depth)`: every step of a stage runs the same tokens, so FLOPs per step are proportional to it)."""
    if recipe.equal_tokens:
        return scratch_steps
    depth = recipe.stages[-1][1]
    bounds = [start for start, _, _ in recipe.stages[1:]] + [1.0]
    mean = sum((end - start) * flops_per_token(d) for (start, d, _), end in zip(recipe.stages, bounds))
    return round(recipe.budget * scratch_steps * flops_per_token(depth) / mean)


def schedule_of(recipe: Recipe, steps: int) -> dict:
    """The trainer fields of `recipe` run for `steps` steps: pseudo_steps (the step of the real delink), the partial
    delinks (steps, blocks, depths), the first stage's depth and blocks, and the recipe's own fields."""
    if len(recipe.stages) == 1:
        return {"pseudo_steps": 0, "real_steps": steps, **recipe.fields}
    at = [round(steps * start) for start, _, _ in recipe.stages[1:]]
    (_, depth, blocks), middle = recipe.stages[0], recipe.stages[1:-1]
    schedule = {"pseudo_steps": at[-1], "real_steps": steps - at[-1], "num_unique_layers": blocks}
    if depth != recipe.stages[-1][1]:
        schedule["pseudo_num_hidden_layers"] = depth
    if middle:
        schedule["partial_delink_steps"] = at[:-1]
        schedule["partial_delink_blocks"] = [k for _, _, k in middle]
        if any(d != depth for _, d, _ in middle):
            schedule["partial_delink_depths"] = [d for _, d, _ in middle]
    return {**schedule, **recipe.fields}


def model_flops(fields: dict):
    """flops_per_token(depth) of the preset's model at `depth` layers (one block each: sharing changes no FLOPs), by
    the trainer's formula (`hf_p2r.training.metrics.training_flops_per_token`) on the trainer's vocabulary."""
    from hf_p2r.training import parse_config
    from hf_p2r.training.data import load_tokenizer
    from hf_p2r.training.metrics import training_flops_per_token

    config = parse_config(trainer_argv({**fields, "pseudo_steps": 0, "real_steps": 1000}))
    vocab = config.model_vocab_size(len(load_tokenizer(config.data.tokenizer_name)))

    def flops_per_token(depth: int) -> float:
        return training_flops_per_token(config.model_fields(vocab, depth, depth), config.data.block_size)

    return flops_per_token


def groups_of(corpora: list[str], optimizers: list[str], depth: int, steps: dict[str, int]) -> list[dict]:
    """The groups (corpus x optimizer) of a study: each with its scratch run's `steps` (`steps[optimizer]`)."""
    return [
        {
            "name": f"{corpus}-L{depth}-{optimizer}",
            "corpus": corpus,
            "optimizer": optimizer,
            "depth": depth,
            "steps": steps[optimizer],
        }
        for corpus in corpora
        for optimizer in optimizers
    ]


def optimizer_steps(preset: dict, overrides: list[tuple[str, int]] | None) -> dict[str, int]:
    """{optimizer: scratch's steps}: the preset's total, except `overrides` ((optimizer, steps) pairs of
    --optimizer-steps: a smaller budget for an optimizer whose steps cost more, e.g. Muon's on a CPU, where torch's
    Newton-Schulz iterations run in bf16)."""
    return {**dict.fromkeys(OPTIMIZERS, preset["total_steps"]), **dict(overrides or [])}


def study_runs(preset: dict, groups: list[dict], names: list[str], seeds: list[int], workdir: Path) -> dict:
    """{(group, seed, recipe): (steps, trainer argv)} of each run of `names` (scratch always) in every group and seed,
    in workdir/GROUP/seedS/NAME; every argv checked by the trainer's parser. A group whose scratch `steps` differ from
    the preset's runs the preset scaled to them (warm-up, evaluation and logging steps scaled alike)."""
    from hf_p2r.training import parse_config

    flops_per_token = model_flops({**preset["fields"], **STUDY_FIELDS})
    runs = {}
    for group in groups:
        book = recipes(group["depth"])
        total = group.get("steps", preset["total_steps"])
        own = preset if total == preset["total_steps"] else scaled(preset, total)
        group_fields = {**own["fields"], **STUDY_FIELDS, "num_hidden_layers": group["depth"]}
        group_fields.update(optimizer=group["optimizer"], **corpus_fields(group["corpus"], preset, workdir.parent))
        for seed in seeds:
            for name in dict.fromkeys(["scratch", *names]):
                steps = solve_steps(book[name], total, flops_per_token)
                output_dir = workdir / group["name"] / f"seed{seed}" / name
                run = {**group_fields, **schedule_of(book[name], steps), "seed": seed}
                run.update(output_dir=str(output_dir), overwrite_output_dir=True)
                argv = trainer_argv(run)
                parse_config(argv)
                runs[group["name"], seed, name] = (steps, argv)
    return runs


def tasks_of(runs: dict) -> list[tuple]:
    """`run_tasks`' (cost, seed, label, argv, log) of `study_runs`' runs not finished yet."""
    tasks = []
    for (group, seed, name), (steps, argv) in runs.items():
        output_dir = output_dir_of(argv)
        if not finished(output_dir, argv):
            output_dir.parent.mkdir(parents=True, exist_ok=True)
            tasks.append((steps, seed, f"{group} {name}", argv, str(output_dir.parent / f"{name}.log")))
    return tasks


# --- the arithmetic (no training) -------------------------------------------------------------------------------------
def curve(records: list[dict], x: str) -> list[tuple[float, float]]:
    """(x, validation loss) of a run's evaluations, x one of step, tokens, flops."""
    return [(record[x], record["val_loss"]) for record in records if "val_loss" in record]


def compare(records: dict[str, list[dict]]) -> dict:
    """One seed of one group: every run against scratch (`records["scratch"]`), by compute, tokens and steps."""
    scratch = records["scratch"]
    last = [r for r in scratch if "val_loss" in r][-1]
    target, budget = last["val_loss"], {"flops": last["flops"], "tokens": last["tokens"], "steps": last["step"]}
    rows = []
    for name, run in records.items():
        evaluations = [r for r in run if "val_loss" in r]
        end = evaluations[-1]
        to_target = {x: crossing(curve(run, x), target) for x in ("flops", "tokens", "step")}
        flops = to_target["flops"]
        reached = next((r for r in evaluations if r["val_loss"] <= target), None)
        # the growth to the real depth: the last evaluation of a shallower model and the first of the grown one
        depth = end.get("num_hidden_layers")
        shallow = [r for r in evaluations if depth and r.get("num_hidden_layers", depth) < depth]
        grown = [r for r in evaluations if shallow and r["step"] > shallow[-1]["step"]]
        growth = None
        if shallow and grown:
            growth = {
                "depth_before": shallow[-1].get("num_hidden_layers"),
                "flops_share": shallow[-1]["flops"] / budget["flops"],
                "loss_before": shallow[-1]["val_loss"],
                "loss_after": grown[0]["val_loss"],
            }
        rows.append(
            {
                "name": name,
                "decay": decay_start(run, budget["flops"]),
                "final_val_loss": end["val_loss"],
                "delta_vs_scratch": end["val_loss"] - target,
                "flops": end["flops"],
                "tokens": end["tokens"],
                "steps": end["step"],
                "budget_ratio": end["flops"] / budget["flops"],
                "flops_to_target": flops,
                "tokens_to_target": to_target["tokens"],
                "steps_to_target": to_target["step"],
                "speedup_flops": None if not flops else budget["flops"] / flops,
                # the depth of the model at the first evaluation at or below the target (shallow: before the growth)
                "depth_at_target": None if reached is None else reached.get("num_hidden_layers"),
                # the loss before and after the growth to L, and the share of scratch's FLOPs spent before it
                "growth": growth,
                # the loss where it has seen scratch's tokens in all (mid-schedule when it runs more tokens)
                "loss_at_scratch_tokens": value_at(curve(run, "tokens"), budget["tokens"]),
                "flops_curve": curve(run, "flops"),
            }
        )
    for row in rows:  # a run of a budget below scratch's FLOPs against the full-budget runs at its FLOPs
        short = re.fullmatch(r"(.+)-b(\d+)", row["name"])
        if short:
            others = [name for name in (short[1], f"scratch-b{short[2]}") if name in records and name != row["name"]]
            row["at_same_flops"] = {name: value_at(curve(records[name], "flops"), row["flops"]) for name in others}
    return {"target": target, "scratch": budget, "runs": rows}


def decay_start(records: list[dict], flops: float) -> dict | None:
    """Where a run's learning rate first fell from its peak (WSD: the start of its decay, to the nearest logged step):
    {"flops_share" (of `flops`, scratch's), "loss": the validation loss at the last evaluation before it}; None when
    no logged learning rate fell."""
    logged = [r for r in records if "lr" in r]
    if not logged:
        return None
    peak = max(r["lr"] for r in logged)
    at_peak = next(i for i, r in enumerate(logged) if r["lr"] == peak)
    start = next((r for r in logged[at_peak:] if r["lr"] < peak), None)
    if start is None:
        return None
    before = [r for r in records if "val_loss" in r and r["step"] <= start["step"]]
    if not before:
        return None
    return {"flops_share": start["flops"] / flops, "loss": before[-1]["val_loss"]}


def worst(speedups: list[float | None]) -> float:
    """The smallest speed-up over seeds (0 when a seed never reached scratch's final loss)."""
    return min((x or 0.0) for x in speedups)


def recommend(groups: list[dict]) -> dict | None:
    """The recipe (not scratch, not an equal-token variant) with the largest worst speed-up over every group and seed
    it ran in, among those that ran in every group: {name, worst, by_group: {group: [speed-up per seed]}}."""
    table: dict[str, dict[str, list]] = {}
    for group in groups:
        for name, speedups in group["speedups"].items():
            table.setdefault(name, {})[group["name"]] = speedups
    candidates = [
        {"name": name, "worst": worst([x for seeds in by_group.values() for x in seeds]), "by_group": by_group}
        for name, by_group in table.items()
        if name != "scratch" and not name.endswith("-tok") and len(by_group) == len(groups)
    ]
    return max(candidates, key=lambda c: c["worst"], default=None)


# --- the study --------------------------------------------------------------------------------------------------------
def collect(runs: dict, groups: list[dict], seeds: list[int]) -> list[dict]:
    """The finished runs of `study_runs`' `runs` (a run with exactly those arguments), each seed compared with its
    scratch run: the groups with at least one."""
    out = []
    for group in groups:
        per_seed = []
        for seed in seeds:
            done = {
                name: read_metrics(output_dir_of(argv) / "metrics.jsonl")
                for (name_of_group, run_seed, name), (_, argv) in runs.items()
                if (name_of_group, run_seed) == (group["name"], seed) and finished(output_dir_of(argv), argv)
            }
            if "scratch" in done:
                per_seed.append({"seed": seed, **compare(done)})
        if not per_seed:
            continue
        names = [
            r["name"] for r in per_seed[0]["runs"] if all(r["name"] in {x["name"] for x in s["runs"]} for s in per_seed)
        ]
        speedups = {
            name: [next(r for r in s["runs"] if r["name"] == name)["speedup_flops"] for s in per_seed] for name in names
        }
        # every recipe with a finished run, and the seeds it has (`speedups` holds only those run at every seed)
        ran: dict[str, list[int]] = {}
        for s in per_seed:
            for r in s["runs"]:
                ran.setdefault(r["name"], []).append(s["seed"])
        out.append(
            {**group, "seeds": [s["seed"] for s in per_seed], "per_seed": per_seed, "speedups": speedups, "ran": ran}
        )
    return out


def run_study(args, preset: dict) -> dict:
    """Run the study's missing runs (`args.only` recipes, or all; `args.seeds`, `args.corpora`, `args.optimizers`),
    then build the result from every finished run."""
    depth = preset["fields"]["num_hidden_layers"]
    book = recipes(depth)
    names = list(book) if not args.only else [n for n in book if n in args.only]
    if args.only and (unknown := sorted(set(args.only) - set(book))):
        raise SystemExit(f"--only: unknown recipes {unknown}; the study has {list(book)}")
    seeds = args.seeds or preset["seeds"]
    workdir = Path(args.workdir) / "compute"
    steps = optimizer_steps(preset, getattr(args, "optimizer_steps", None))
    info = machine()
    info["torch_threads"] = args.threads
    started = time.perf_counter()
    ran = 0
    if not args.report:
        wanted = study_runs(preset, groups_of(args.corpora, args.optimizers, depth, steps), names, seeds, workdir)
        todo = tasks_of(wanted)
        jobs = args.jobs or preset["jobs"]
        print(f"compute: {len(todo)} of {len(wanted)} runs, {jobs} at a time; logs in {workdir}", flush=True)
        loads = [info["load_average_at_start"][0]]
        if not run_tasks(todo, jobs, args.threads, loads):
            raise RuntimeError("a run of the compute study failed (see its log)")
        load_at_end(info, loads)
        ran = len(todo)
    every = groups_of(list(CORPORA), list(OPTIMIZERS), depth, steps)
    all_seeds = sorted({*preset["seeds"], *seeds})
    groups = collect(study_runs(preset, every, list(book), all_seeds, workdir), every, all_seeds)
    invocation = {
        "command": "python scripts/bench_convergence.py " + " ".join(args.argv),
        "machine": info,
        "ran": ran,
        "wall_time_s": time.perf_counter() - started,
    }
    return {
        "study": "compute",
        "preset": preset,
        "study_fields": STUDY_FIELDS,
        "target": TARGET,
        "plan": {
            "recipes": described(book),
            "corpora": list(CORPORA),
            "optimizers": list(OPTIMIZERS),
            "seeds": preset["seeds"],
            "steps": steps,
        },
        "invocations": [invocation],
        "groups": groups,
        "recommended": recommend(groups),
    }


def described(book: dict[str, Recipe]) -> dict[str, dict]:
    """The page's (and the JSON's) account of each recipe: what it is, its stages, fields and budget."""
    return {
        name: {
            "what": r.what,
            "stages": r.stages,
            "fields": r.fields,
            "budget": r.budget,
            "equal_tokens": r.equal_tokens,
        }
        for name, r in book.items()
    }


def merge(previous: dict | None, result: dict) -> dict:
    """`result` with the invocations of `previous` before its own (the groups are rebuilt from the runs on disk)."""
    if previous is None or previous.get("preset", {}).get("fields") != result["preset"]["fields"]:
        return result
    return {**result, "invocations": previous["invocations"] + result["invocations"]}


# --- the page ---------------------------------------------------------------------------------------------------------
def _x(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}x"


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _growth(growth: dict | None) -> str:
    if growth is None:
        return "-"
    return f"{growth['loss_before']:.4f} -> {growth['loss_after']:.4f} ({growth['flops_share']:.0%})"


def _why(row: dict, seed: dict) -> str:
    """Why a run's speed-up is under the target, from its measured curve: where its FLOPs went before the growth,
    the loss there and after it, and where it reached scratch's final loss."""
    target, growth = seed["target"], row.get("growth")
    if growth is None:
        return "no growth to L recorded (the run's stages are in its metrics)."
    text = (
        f"{growth['flops_share']:.0%} of scratch's FLOPs went to the "
        + (f"{growth['depth_before']}-layer" if growth.get("depth_before") else "shallow")
        + f" start, which ended at {growth['loss_before']:.4f} ({growth['loss_before'] - target:+.4f} from scratch's "
        f"final {target:.4f}); at the first evaluation after the growth the loss was {growth['loss_after']:.4f} "
        f"({growth['loss_after'] - growth['loss_before']:+.4f}); "
    )
    decay = row.get("decay")
    if decay is not None:
        text += (
            f"its learning rate began to decay at {decay['flops_share']:.0%} of scratch's FLOPs, the loss then "
            f"{decay['loss']:.4f} ({decay['loss'] - target:+.4f}); "
        )
    if not row["flops_to_target"]:
        return text + "the grown model never reached scratch's final loss."
    shallow = row.get("depth_at_target") and row["depth_at_target"] <= (growth.get("depth_before") or 0)
    share = row["flops_to_target"] / seed["scratch"]["flops"]
    return text + (
        f"the {'shallow' if shallow else 'grown'} model reached scratch's final loss at {share:.0%} of scratch's "
        f"FLOPs ({1 / TARGET:.0%} or less is {TARGET:g}x)."
    )


def markdown(result: dict) -> str:
    p, plan, groups = result["preset"], result["plan"], result["groups"]
    f = p["fields"]
    lines = [
        "# Compute to loss: growth against scratch at equal compute (issue 39)",
        "",
        "Generated by `scripts/bench_convergence.py --compute` (benchmarks/convergence/compute.py) from the runs "
        "finished so far; every figure below is read from the trainer's own `metrics.jsonl` (`flops`, `tokens`).",
        "",
        "## How it was run",
        "",
    ]
    for invocation in result["invocations"]:
        m = invocation["machine"]
        load = (
            f"load average {m['load_average_at_start'][0]:.1f} at the start, {m['load_average_at_end'][0]:.1f} at "
            f"the end, {m['load_average_max']:.1f} at most"
            if "load_average_at_end" in m
            else f"load average {m['load_average_at_start'][0]:.1f} at the start"
        )
        lines.append(
            f"- `{invocation['command']}`: {m['date']}, {m['cpu']} ({m['cpu_count']} cores, shared; "
            f"{m['torch_threads']} torch thread(s) per run), torch {m['torch']}; {invocation['ran']} runs in "
            f"{invocation['wall_time_s'] / 60:.1f} min; {load}."
        )
    lines += [
        "",
        f"Model: L={f['num_hidden_layers']} layers, hidden {f['hidden_size']}, MLP {f['intermediate_size']}, "
        f"{f['num_attention_heads']} heads, the byte-level tokenizer; {f['per_device_batch_size']} x "
        f"{f['block_size']} tokens per step, peak learning rate {f['learning_rate']}, warm-up {f['warmup_steps']} "
        f"steps, every run under `lr_scheduler: wsd` (decay: the last fifth of its own steps), evaluated every "
        f"{f['eval_steps']} steps on {f['eval_blocks']} held-out blocks. Scratch runs {p['total_steps']} steps"
        + "".join(
            f" ({optimizer}: {steps}, its step counts scaled alike)"
            for optimizer, steps in plan.get("steps", {}).items()
            if steps != p["total_steps"]
        )
        + "; every other run spends its budget (the table's) of its scratch run's FLOPs, its steps solved from the "
        "FLOPs of each stage's depth and its stages and decay placed in its own steps, except the `-tok` runs, which "
        "run scratch's steps (equal tokens).",
        "",
        "| recipe | what | stages (start of run, depth, blocks) | fields | budget (of scratch's FLOPs) |",
        "|---|---|---|---|---|",
    ]
    for name, recipe in plan["recipes"].items():
        stages = ", ".join(f"{start:.0%}: {d}/{k}" for start, d, k in recipe["stages"])
        fields = ", ".join(f"{k}={v}" for k, v in recipe["fields"].items()) or "-"
        budget = "scratch's steps" if recipe.get("equal_tokens") else f"{recipe.get('budget', 1.0):.0%}"
        lines.append(f"| {name} | {recipe['what']} | {stages} | {fields} | {budget} |")
    lines += ["", "## What ran, and what did not", ""]
    ran = {(g["name"], seed) for g in groups for seed in g["seeds"]}
    full = [
        (f"{corpus}-L{f['num_hidden_layers']}-{optimizer}", seed)
        for corpus in plan["corpora"]
        for optimizer in plan["optimizers"]
        for seed in plan["seeds"]
    ]
    for group in groups:
        names = list(group["speedups"])
        some = [
            f"{name} (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))})"
            for name, seeds in group["ran"].items()
            if name not in names
        ]
        lines.append(
            f"- {group['name']}, seeds {group['seeds']}: {', '.join(names)}"
            + (f"; at some seeds only: {', '.join(some)}." if some else ".")
        )
    missing = [f"{name} seed {seed}" for name, seed in full if (name, seed) not in ran]
    absent = sorted({name for name in plan["recipes"]} - {n for g in groups for n in g["ran"]})
    if missing:
        lines.append(f"- Not run (no scratch run, so nothing to compare): {', '.join(missing)}.")
    if absent:
        lines.append(f"- Recipes not run in any group: {', '.join(absent)}.")
    lines += ["", "## Results", ""]
    lines.append(
        "Speed-up = scratch's FLOPs / the run's FLOPs to reach scratch's final validation loss. Budget = the run's "
        "FLOPs / scratch's. Loss at scratch's tokens: the run's validation loss after as many tokens as scratch saw "
        "in all (mid-schedule for a run with more tokens), minus scratch's final loss. Depth there: the depth of the "
        "model at the first evaluation at or below scratch's final loss (below L: the shallow model reached it before "
        "the growth, so scratch's budget is short of what its depth needs). Growth: the validation loss at the last "
        "evaluation before the growth to L and at the first after it, and the share of scratch's FLOPs spent before "
        "it."
    )
    for group in groups:
        lines += ["", f"### {group['name']} (scratch: {group.get('steps', p['total_steps'])} steps)", ""]
        lines += [
            "| run | seed | final val loss | Δ vs scratch | budget | steps | tokens | FLOPs | FLOPs to target "
            "| speed-up | depth there | growth: loss before -> after (FLOPs spent) | Δ at scratch's tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for seed in group["per_seed"]:
            for row in seed["runs"]:
                lines.append(
                    f"| {row['name']} | {seed['seed']} | {row['final_val_loss']:.4f} | "
                    f"{row['delta_vs_scratch']:+.4f} | {row['budget_ratio']:.2f} | {row['steps']} | "
                    f"{row['tokens']:,} | {_e(row['flops'])} | {_e(row['flops_to_target'])} | "
                    f"{_x(row['speedup_flops'])} | {row.get('depth_at_target') or '-'} | "
                    f"{_growth(row.get('growth'))} | "
                    f"{row['loss_at_scratch_tokens'] - seed['target']:+.4f} |"
                )
    lines += ["", "## Verdict", ""]
    best = result["recommended"]
    if best is None:
        lines.append("No recipe ran in every group measured so far: no recommendation.")
    else:
        seeds_run = sorted({s for g in groups for s in g["seeds"]})
        met = best["worst"] >= TARGET
        lines.append(
            f"Recommended (largest worst-seed speed-up over every group measured): **{best['name']}**, worst "
            f"{_x(best['worst'] or None)} over {len(groups)} group(s) and seed(s) {seeds_run}: it "
            + (
                f"meets the {TARGET:g}x target in every group measured."
                if met
                else f"misses the {TARGET:g}x target by {TARGET - best['worst']:.2f}x at its worst."
                if best["worst"]
                else "does not reach scratch's final loss at its worst (its final loss is in the table)."
            )
        )
        for name, speedups in best["by_group"].items():
            lines.append(f"- {name}: {', '.join(_x(x) for x in speedups)}")
        depth = f["num_hidden_layers"]
        early = [
            (group["name"], seed["seed"], row["depth_at_target"], row["delta_vs_scratch"])
            for group in groups
            for seed in group["per_seed"]
            for row in seed["runs"]
            if row["name"] == best["name"] and (row.get("depth_at_target") or depth) < depth
        ]
        if early:
            where = ", ".join(f"{name} seed {seed} (at depth {d}; final {dv:+.4f})" for name, seed, d, dv in early)
            lines.append(
                f"- {best['name']} reached scratch's final loss before its growth, with its shallow model, in {where}: "
                "at this budget scratch's final loss is within a shallow model's reach (scratch is short of the "
                "steps its depth needs), so the speed-up measures the shallow start, not the growth; the final loss "
                "below scratch's is what the run reaches after growing."
            )
        for group in groups:
            for seed in group["per_seed"]:
                row = next((r for r in seed["runs"] if r["name"] == best["name"]), None)
                if row is not None and (row["speedup_flops"] or 0.0) < TARGET:
                    lines.append(
                        f"- {group['name']} seed {seed['seed']}: {_x(row['speedup_flops'])}: {_why(row, seed)}"
                    )
        if set(plan["seeds"]) - set(seeds_run) or len(groups) < len(plan["corpora"]) * len(plan["optimizers"]):
            lines.append(
                "- The target is judged at every seed on both corpora with AdamW and Muon; the groups and seeds "
                "listed as not run above are not measured, so the target is not shown met for them."
            )
        lines.append("")
        lines.append(
            "Every recipe's worst speed-up over the groups it ran in, and its final validation loss against scratch's "
            "at the group and seed where it ended highest:"
        )
        lines.append("")
        table: dict[str, list] = {}
        ends: dict[str, list] = {}
        for group in groups:
            for name, speedups in group["speedups"].items():
                table.setdefault(name, []).extend(speedups)
            for seed in group["per_seed"]:
                for row in seed["runs"]:
                    if row["name"] in group["speedups"]:
                        ends.setdefault(row["name"], []).append((row["delta_vs_scratch"], group["name"], seed["seed"]))
        # by worst speed-up, then (those never reaching scratch's loss) by how close they ended to it
        for name, speedups in sorted(table.items(), key=lambda item: (-worst(item[1]), max(ends[item[0]])[0])):
            if name != "scratch":
                delta, group_name, seed_number = max(ends[name])
                lines.append(
                    f"- {name}: worst {_x(worst(speedups) or None)} ({len(speedups)} group-seeds); final loss at most "
                    f"{delta:+.4f} from scratch's ({group_name} seed {seed_number})"
                )
        lines += _budgets(groups)
        lines += _partial(groups, best)
    return "\n".join(lines) + "\n"


def _budgets(groups: list[dict]) -> list[str]:
    """The runs of a budget below scratch's FLOPs (`-bNN`): each final loss against, at the same FLOPs, the same
    recipe run on scratch's whole budget (mid-schedule there: what the earlier decay is worth) and scratch's model run
    on the same budget (`scratch-bNN`, its own decay: the equal-compute control)."""
    lines = []
    for group in groups:
        for seed in group["per_seed"]:
            for row in seed["runs"]:
                if row.get("at_same_flops"):
                    others = ", ".join(f"{name} {loss:.4f}" for name, loss in row["at_same_flops"].items())
                    lines.append(
                        f"- {row['name']}, {group['name']} seed {seed['seed']}: final {row['final_val_loss']:.4f} at "
                        f"{row['budget_ratio']:.0%} of scratch's FLOPs; there: {others}"
                    )
    if not lines:
        return []
    return [
        "",
        "Runs of a budget below scratch's FLOPs against, at the same FLOPs, the recipe run on scratch's whole budget "
        "(mid-schedule, its decay still ahead) and scratch's model run on the same budget (its own decay):",
        "",
        *lines,
    ]


def _partial(groups: list[dict], best: dict) -> list[str]:
    """The recipes run at some seeds of a group only (not candidates: the recommendation needs every group and seed):
    each run's speed-up, whether it beats the recommended recipe's worst on every run it has, and, where it does, why
    each of its runs is under the target (`_why`)."""
    runs: dict[str, list[tuple[dict, dict, dict]]] = {}
    for group in groups:
        for name in group["ran"]:
            if name in group["speedups"]:
                continue
            for seed in group["per_seed"]:
                row = next((r for r in seed["runs"] if r["name"] == name), None)
                if row is not None:
                    runs.setdefault(name, []).append((group, seed, row))
    if not runs:
        return []
    lines = [
        "",
        "Recipes run at some seeds only (not candidates for the recommendation, which needs every group and seed):",
        "",
    ]
    for name, rows in runs.items():
        # the recommended recipe's speed-up at the same group and seed (it ran at every one: None is not reached)
        theirs = [next(x["speedup_flops"] for x in s["runs"] if x["name"] == best["name"]) for _, s, _ in rows]
        each = ", ".join(
            f"{g['name']} seed {s['seed']} {_x(r['speedup_flops'])} ({best['name']}: {_x(other)})"
            for (g, s, r), other in zip(rows, theirs)
        )
        beats = all((r["speedup_flops"] or 0.0) > best["worst"] for _, _, r in rows)
        below = sum((r["speedup_flops"] or 0.0) < (other or 0.0) for (_, _, r), other in zip(rows, theirs))
        lines.append(
            f"- {name}: {each}; "
            + (
                f"above {best['name']}'s worst ({_x(best['worst'])}) at every run it has, "
                + (
                    f"below it at the same group and seed in {below} of {len(rows)}."
                    if below
                    else "and not below it at the same group and seed."
                )
                if beats
                else f"not above {best['name']}'s worst ({_x(best['worst'])}) at every run it has."
            )
        )
        if beats:
            lines += [
                f"  - {g['name']} seed {s['seed']}: {_x(r['speedup_flops'])}: {_why(r, s)}"
                for g, s, r in rows
                if (r["speedup_flops"] or 0.0) < TARGET
            ]
    return lines


def write_page(result: dict, out: Path) -> Path:
    write_json(out / f"{STEM}.json", result)
    write_text(out / f"{STEM}.md", markdown(result))
    return out / f"{STEM}.md"


def main(args, preset: dict) -> int:
    out = Path(args.out)
    path = out / f"{STEM}.json"
    previous = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    result = run_study(args, preset)
    if args.report and previous is not None:
        result["invocations"] = previous["invocations"]
    else:
        result = merge(previous, result)
    print(f"wrote {write_page(result, out)}")
    return 0


__all__ = ["Recipe", "compare", "main", "recipes", "recommend", "schedule_of", "solve_steps"]
