"""The convergence sweeps (issue 13): when does P2R pay off? The learning-rate schedule, the depth, the growth
schedule and the delink point, each on two corpora; every P2R run compared seed by seed with a scratch run of its
group (same corpus, depth and schedule)."""

import os
import statistics
import time
from pathlib import Path

from benchmarks.convergence.analysis import aggregate, compare_seed, stage_times
from benchmarks.convergence.runs import (
    block_parameters,
    budget_runs,
    finished,
    load_at_end,
    machine,
    records_of,
    run_tasks,
    trainer_argv,
)
from hf_p2r.training import parse_config

# `--sweep NAME` runs one and writes convergence_NAME.json; `--report` builds convergence.md (findings, tables) and its
# plots from every sweep file present.
SWEEPS = ("schedule", "depth", "growth", "best", "muon")
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
    # The recommended configuration (growth from one block, last delink at a third, cosine) and scratch, under
    # `optimizer: muon` and under AdamW, run together (same code, same machine): issue 27's P2R under Muon.
    "muon": {"schedulers": ["cosine"], "depths": [8], "fractions": [1 / 3]},
}
# The optimizers a sweep runs each group under (a group per optimizer, the trainer's `optimizer` field set); the other
# sweeps leave it unset (AdamW, the trainer's default).
SWEEP_OPTIMIZERS = {"muon": ("adamw", "muon")}
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
                        "muon": [(1, True)],
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
                for optimizer in SWEEP_OPTIMIZERS.get(sweep, (None,)):
                    group = {
                        "name": f"{corpus}-L{depth}-{scheduler}" + (f"-{optimizer}" if optimizer else ""),
                        "corpus": corpus,
                        "depth": depth,
                        "scheduler": scheduler,
                        "fields": {"num_hidden_layers": depth, "lr_scheduler": scheduler},
                        "runs": dict(runs),
                    }
                    if optimizer:
                        group["optimizer"] = group["fields"]["optimizer"] = optimizer
                    groups.append(group)
    return groups


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
                argv_run = trainer_argv(fields)
                parse_config(argv_run)  # a bad --set fails here, before any run
                output_dir.parent.mkdir(parents=True, exist_ok=True)
                if finished(output_dir, argv_run):
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
            records = records_of(folder / f"seed{seed}", {**group["runs"], **budgets})
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
    load_at_end(info, loads)
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


def group_order(group: dict) -> tuple:
    """Where a group stands in a page and a sweep file: by corpus (as `CORPORA` lists them), depth, schedule."""
    corpora = list(CORPORA)
    corpus = corpora.index(group["corpus"]) if group["corpus"] in corpora else 9
    return corpus, group["depth"], group["scheduler"], group.get("optimizer", "")


def merge_sweep(previous: dict | None, result: dict) -> dict:
    """`result` with the groups of `previous` (an earlier run of the same sweep) that it did not run again, and its
    invocations before this one: a sweep can be run in parts (e.g. --depths 32 later, with fewer seeds)."""
    if previous is None or previous.get("preset", {}).get("fields") != result["preset"]["fields"]:
        return result
    names = {g["name"] for g in result["groups"]}
    kept = [g for g in previous["groups"] if g["name"] not in names]
    groups = sorted(kept + result["groups"], key=group_order)
    corpora = list(dict.fromkeys([*previous["corpora"], *result["corpora"]]))
    return {
        **result,
        "corpora": corpora,
        "invocations": previous["invocations"] + result["invocations"],
        "groups": groups,
    }
