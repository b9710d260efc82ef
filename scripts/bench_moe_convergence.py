"""MoE convergence benchmark: the real MoE model trained from scratch against P2R (pseudo MoE -> delink -> real MoE).

`scripts/bench_convergence.py`'s method and report, on mixture-of-experts models (its `scaled`, `runs_of`,
`budget_runs`, `run_tasks`, `compare_seed`, `aggregate`, `markdown`, `plot`): every run has the same data, seed,
learning-rate schedule and step budget; each seed repeats every run and P2R is compared with scratch seed by seed.
The speed-up in steps to scratch's final validation loss is the primary figure, with the speed-up at equal final
loss (against scratch runs with other budgets). The model is the dense CPU preset's with every layer sparse, as
configs/demo_moe.yaml is the dense demo's: 4 experts of half the dense FFN, top-2, so a token's FFN compute is the
dense model's; the P2R runs share whole blocks (attention, router and experts) and delink with the `scale` carry.

    nice -n 10 python scripts/bench_moe_convergence.py    # 3 seeds x 5 runs, 2 at a time: ~25 min, 2 shared cores
    python scripts/bench_moe_convergence.py --steps 12 --seeds 0 --set hidden_size=32 intermediate_size=64 \
        moe_intermediate_size=32 --workdir /tmp/bench_moe --out /tmp/bench_moe/report      # smoke run

Writes benchmarks/moe_convergence.{json,md,png} (machine, date, load and wall time recorded); the runs and their logs
go to --workdir.
"""

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from hf_p2r.training import parse_config
from hf_p2r.training.metrics import read_metrics

_spec = importlib.util.spec_from_file_location("bench_convergence", Path(__file__).with_name("bench_convergence.py"))
bench_convergence = importlib.util.module_from_spec(_spec)
# Under its own name: the runs go to spawned workers, which find `bench_convergence._train_run` by importing it.
sys.modules.setdefault("bench_convergence", bench_convergence)
_spec.loader.exec_module(bench_convergence)

# The dense CPU preset's fields (model, data, optimisation) with sparse layers; fewer steps and one delink point, so
# that 3 seeds fit in ~25 minutes on 2 cores shared with other work.
_DENSE = bench_convergence.PRESETS["cpu"]
PRESETS = {
    "cpu": {
        "total_steps": 150,
        "delink_steps": [50],
        "carry_delink_step": 50,
        "budgets": [0.5, 1.5],
        "seeds": list(_DENSE["seeds"]),
        "jobs": 2,
        "fields": {
            **copy.deepcopy(_DENSE["fields"]),
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": _DENSE["fields"]["intermediate_size"] // 2,
            "router_aux_loss_coef": 0.01,
            "eval_steps": 15,
            "eval_blocks": 64,
        },
    },
}
CARRY = "scale"  # configs/demo_moe.yaml's, and the dense benchmark's default recipe


def moe_runs(preset: dict) -> dict[str, dict]:
    """Scratch, P2R with the preset's k and with k = 1 (M6-10T's fully shared giant), both delinked at the preset's
    delink step with the `scale` carry: `bench_convergence.runs_of`'s runs of those names."""
    runs = bench_convergence.runs_of(preset)
    k, at = preset["fields"]["num_unique_layers"], preset["carry_delink_step"]
    return {name: runs[name] for name in ("scratch", f"k{k}-{CARRY}-at{at}", f"k1-{CARRY}-at{at}") if name in runs}


def tasks_of(preset: dict, runs: dict, budgets: dict, seeds: list[int], workdir: Path) -> list[tuple]:
    """(steps, seed, name, trainer argv, log) of every run of every seed, each argv checked by the trainer's parser."""
    tasks = []
    for seed in seeds:
        for name, schedule in {**runs, **budgets}.items():
            output_dir = workdir / f"seed{seed}" / name
            fields = {**preset["fields"], **schedule, "seed": seed, "output_dir": str(output_dir)}
            fields["overwrite_output_dir"] = True
            argv = [item for key, value in fields.items() for item in (f"--{key}", str(value))]
            config = parse_config(argv)  # a bad --set fails here, before any run
            if not config.model.num_experts:
                raise ValueError(f"{name}: num_experts is 0: not a MoE run")
            steps = schedule["pseudo_steps"] + schedule["real_steps"]
            tasks.append((steps, seed, name, argv, str(workdir / f"seed{seed}" / f"{name}.log")))
    return tasks


def moe_markdown(result: dict) -> str:
    """`bench_convergence.markdown`'s page, titled for MoE, with the MoE model and the run sizes stated first."""
    f, p = result["preset"]["fields"], result["preset"]
    lines = bench_convergence.markdown(result).split("\n")
    lines[0] = "# MoE convergence: real MoE model from scratch vs P2R (pseudo MoE → delink → real MoE)"
    about = (
        f"Mixture-of-experts models (`P2RMoeForCausalLM`, `scripts/bench_moe_convergence.py`): every one of the "
        f"{f['num_hidden_layers']} layers sparse, {f['num_experts']} experts of width {f['moe_intermediate_size']} "
        f"(top-{f['num_experts_per_tok']}: a token's FFN compute is that of one dense FFN of width "
        f"{int(f['moe_intermediate_size']) * int(f['num_experts_per_tok'])}), load-balancing loss weight "
        f"{f['router_aux_loss_coef']:g} (computed per depth, so a shared router counts once per depth it runs at); "
        f"attention, data and optimisation as the dense CPU preset of `benchmarks/convergence_carry.md`, hidden "
        f"{f['hidden_size']}, {p['total_steps']} steps (the dense preset: 300), validation on {f['eval_blocks']} "
        f"blocks every {f['eval_steps']} steps (the dense preset: 128 every 25), and one delink point, step "
        f"{p['carry_delink_step']}, with the `{CARRY}` carry, so that {len(result['seed_list'])} seeds fit in about "
        "25 minutes on 2 CPU cores shared with other work (run under `nice -n 10`). The pseudo models share whole "
        "blocks: attention, router and experts. The 1.5x target below is the dense issue's, kept for comparison."
    )
    return "\n".join([lines[0], "", about, *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workdir", default="runs/bench_moe", help="where the runs write (default: runs/bench_moe)")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    parser.add_argument("--jobs", type=int, help="runs at a time, each in its own process (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to repeat every run with (default: the preset's)")
    parser.add_argument("--steps", type=int, help="total steps; the delink point, warm-up, evaluation scale alike")
    parser.add_argument("--budgets", type=float, nargs="*", help="extra scratch budgets, fractions of the total")
    parser.add_argument(
        "--set", type=bench_convergence._override, nargs="+", default=[], metavar="FIELD=VALUE", help="field overrides"
    )
    args = parser.parse_args(argv)
    preset = bench_convergence.scaled(PRESETS[args.preset], args.steps, dict(args.set))
    if args.budgets is not None:
        preset["budgets"] = args.budgets
    seeds, jobs = args.seeds or preset["seeds"], args.jobs or preset["jobs"]
    runs, budgets = moe_runs(preset), bench_convergence.budget_runs(preset)
    workdir = Path(args.workdir) / args.preset
    started = time.perf_counter()
    info = bench_convergence.machine()
    info["torch_threads"] = args.threads
    tasks = tasks_of(preset, runs, budgets, seeds, workdir)
    # A run finished with the same arguments (an earlier, interrupted benchmark) is not run again.
    todo = [t for t in tasks if not bench_convergence._finished(Path(t[3][t[3].index("--output_dir") + 1]), t[3])]
    for seed in seeds:
        (workdir / f"seed{seed}").mkdir(parents=True, exist_ok=True)
    print(f"{len(todo)} of {len(tasks)} runs ({len(seeds)} seeds), {jobs} at a time; logs in {workdir}", flush=True)
    loads = [info["load_average_at_start"][0]]
    if not bench_convergence.run_tasks(todo, jobs, args.threads, loads):
        return 1

    per_seed = []
    for seed in seeds:
        records = {name: read_metrics(workdir / f"seed{seed}" / name / "metrics.jsonl") for name in {**runs, **budgets}}
        per_seed.append(bench_convergence.compare_seed(seed, runs, records, budgets))
    info["load_average_at_end"] = os.getloadavg()
    info["load_average_max"] = max(loads + [info["load_average_at_end"][0]])
    folder = workdir / f"seed{seeds[0]}"
    pseudo = next(name for name, schedule in runs.items() if schedule["pseudo_steps"])
    result = {
        "preset_name": f"moe-{args.preset}",
        "preset": preset,
        "machine": info,
        "jobs": jobs,
        "seed_list": seeds,
        "wall_time_s": time.perf_counter() - started,
        "runs_reused": len(tasks) - len(todo),
        "parameters": {
            "real": bench_convergence._parameters(folder / "scratch" / "real"),
            "pseudo": bench_convergence._parameters(folder / pseudo / "pseudo"),
        },
        "plot": "moe_convergence.png",
        "runs": bench_convergence.aggregate(per_seed),
        "seeds": per_seed,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_convergence.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "moe_convergence.md").write_text(moe_markdown(result), encoding="utf-8")
    if not bench_convergence.plot(result, out / "moe_convergence.png"):
        print("matplotlib is not installed: skipped moe_convergence.png")
    print(moe_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
