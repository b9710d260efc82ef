"""benchmarks/moe_convergence.py: its runs are MoE runs of the dense benchmark's schedules, and its page is the dense
benchmark's, for MoE (no training here: synthetic curves)."""

from pathlib import Path

from benchmarks import moe_convergence as bench
from benchmarks.convergence import analysis
from benchmarks.convergence import runs as dense
from hf_p2r.training import parse_config


def test_runs_are_moe_runs_of_the_dense_schedules(tmp_path):
    preset = bench.PRESETS["cpu"]
    runs = bench.moe_runs(preset)
    assert list(runs) == ["scratch", "k2-scale-at50", "k1-scale-at50"]
    assert runs["k1-scale-at50"] == {"pseudo_steps": 50, "real_steps": 100, "optimizer_carry": "scale",
                                     "num_unique_layers": 1}  # fmt: skip
    budgets = dense.budget_runs(preset)
    tasks = bench.tasks_of(preset, runs, budgets, [0, 1], tmp_path)
    assert len(tasks) == 2 * (len(runs) + len(budgets)) == 10
    for steps, seed, name, argv, log in tasks:
        config = parse_config(argv)
        assert (config.model.num_experts, config.model.moe_intermediate_size) == (4, 128), name
        assert config.train.seed == seed and Path(config.train.output_dir) == tmp_path / f"seed{seed}" / name
        assert steps == config.train.pseudo_steps + config.train.real_steps and log.endswith(f"{name}.log")
    scaled = dense.scaled(preset, 30)
    assert list(bench.moe_runs(scaled)) == ["scratch", "k2-scale-at10", "k1-scale-at10"]


def _records(curve, seconds_per_step):
    return [{"step": s, "val_loss": v, **({"train_time_s": s * seconds_per_step} if s else {})} for s, v in curve]


def test_page_is_the_dense_page_for_moe():
    preset = bench.PRESETS["cpu"]
    runs, budgets = bench.moe_runs(preset), dense.budget_runs(preset)
    curves = {
        "scratch": [(0, 5.0), (75, 3.0), (150, 2.0)],
        "k2-scale-at50": [(0, 5.0), (75, 2.6), (150, 1.8)],
        "k1-scale-at50": [(0, 5.0), (75, 3.2), (150, 2.1)],
        "scratch-x0.5": [(75, 2.5)],
        "scratch-x1.5": [(225, 1.7)],
    }
    records = {name: _records(curve, 0.5) for name, curve in curves.items()}
    per_seed = [analysis.compare_seed(0, runs, records, budgets)]
    result = {
        "preset_name": "moe-cpu",
        "preset": preset,
        "machine": dense.machine() | {"load_average_max": 1.0, "load_average_at_end": (1.0, 1, 1)},
        "jobs": 2,
        "seed_list": [0],
        "wall_time_s": 60.0,
        "parameters": {"real": 100, "pseudo": 40},
        "plot": "moe_convergence.png",
        "runs": analysis.aggregate(per_seed),
        "seeds": per_seed,
    }
    page = bench.moe_markdown(result)
    assert page.startswith("# MoE convergence: real MoE model from scratch vs P2R")
    assert "4 experts of width 128 (top-2: a token's FFN compute is that of one dense FFN of width 256)" in page
    k2 = result["runs"][1]
    assert k2["name"] == "k2-scale-at50" and k2["speedup_steps_per_seed"][0] > 1.0
    assert f"| k2-scale-at50 | 50 | 1.8000 | -0.2000 ± 0.0000 | {k2['speedup_steps_per_seed'][0]:.2f}x |" in page
