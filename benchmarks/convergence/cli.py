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
    python scripts/bench_convergence.py --compute        # growth at equal compute (benchmarks/convergence/compute.py)

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
import json
import sys
from pathlib import Path

from benchmarks.convergence import compute
from benchmarks.convergence.analysis import aggregate
from benchmarks.convergence.report import markdown, report_stem, write_report
from benchmarks.convergence.runs import (
    PRESETS,
    budget_runs,
    command_line,
    parameters,
    run_study,
    runs_of,
    scaled,
    tasks_of,
)
from benchmarks.convergence.sweep_report import write_sweep_report
from benchmarks.convergence.sweeps import CORPORA, SWEEPS, merge_sweep, run_sweep
from benchmarks.harness import write_json


def _optimizer_steps(text: str) -> tuple[str, int]:
    """--optimizer-steps' OPTIMIZER=STEPS as (optimizer, steps)."""
    optimizer, _, steps = text.partition("=")
    if optimizer not in compute.OPTIMIZERS or not steps.isdigit() or int(steps) < 2:
        raise argparse.ArgumentTypeError(
            f"expected OPTIMIZER=STEPS (OPTIMIZER one of {', '.join(compute.OPTIMIZERS)}, STEPS >= 2), got {text!r}"
        )
    return optimizer, int(steps)


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, PRESETS, "runs/bench")
    parser.add_argument("--runs", nargs="+", help="only these runs (scratch is always run: it is the reference)")
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
    parser.add_argument(
        "--compute", action="store_true", help="the compute-to-loss study of growth (issue 39): convergence_compute.*"
    )
    parser.add_argument(
        "--optimizers", nargs="+", choices=compute.OPTIMIZERS, default=list(compute.OPTIMIZERS), help="--compute"
    )
    parser.add_argument(
        "--optimizer-steps",
        type=_optimizer_steps,
        nargs="+",
        metavar="OPTIMIZER=STEPS",
        help="--compute: scratch's steps for one optimizer's groups (default: --steps for all), e.g. muon=400",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.compute:
        return compute.main(args, scaled(PRESETS[args.preset], args.steps, dict(args.set)))
    if args.report:
        print(f"wrote {write_sweep_report(Path(args.out))}")
        return 0
    preset = scaled(PRESETS[args.preset], args.steps, dict(args.set))
    if args.budgets is not None:
        preset["budgets"] = args.budgets
    if args.sweep:
        result = run_sweep(args.sweep, args, preset)
        out = Path(args.out)
        path = out / f"convergence_{args.sweep}.json"
        result = merge_sweep(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None, result)
        write_json(path, result)
        print(f"wrote {path}; {write_sweep_report(out)}")
        return 0
    seeds, jobs = args.seeds or preset["seeds"], args.jobs or preset["jobs"]
    runs = runs_of(preset)
    if args.runs:
        unknown = sorted(set(args.runs) - set(runs))
        if unknown:
            parser.error(f"--runs: unknown {unknown}; this preset has {sorted(runs)}")
        runs = {name: schedule for name, schedule in runs.items() if name == "scratch" or name in args.runs}
    budgets = budget_runs(preset)
    workdir = Path(args.workdir) / args.preset
    tasks = tasks_of(preset, runs, budgets, seeds, workdir)
    study = run_study(tasks, runs, budgets, seeds, workdir, jobs, args.threads, reuse=False)
    if study is None:
        return 1
    # Parameter counts from the saved models: scratch's real model, and a pseudo model with the preset's k.
    folder = workdir / f"seed{seeds[0]}"
    k = preset["fields"]["num_unique_layers"]
    pseudo = [name for name, s in runs.items() if s["pseudo_steps"] and s.get("num_unique_layers", k) == k]
    counts = {
        "real": parameters(folder / "scratch" / "real"),
        "pseudo": parameters(folder / pseudo[0] / "pseudo") if pseudo else None,
    }
    stem = report_stem(args.preset)
    result = {
        "preset_name": args.preset,
        "preset": preset,
        "machine": study["machine"],
        "jobs": jobs,
        "seed_list": seeds,
        "wall_time_s": study["wall_time_s"],
        "parameters": counts,
        "plot": f"{stem}.png",
        "runs": aggregate(study["per_seed"]),
        "seeds": study["per_seed"],
    }
    write_report(result, Path(args.out))
    print(markdown(result))
    return 0
