"""benchmarks/convergence/'s arithmetic and report on small synthetic curves (no training)."""

import json

import pytest

from benchmarks.convergence import analysis, report, sweep_report, sweeps
from benchmarks.convergence.runs import PRESETS, budget_runs, runs_of, scaled, trainer_argv
from hf_p2r.training import parse_config


def records(curve: list[tuple[int, float]], seconds_per_step: float) -> list[dict]:
    """metrics.jsonl records: a validation loss at each point, training time logged with it (none at step 0)."""
    out = []
    for step, loss in curve:
        record = {"step": step, "val_loss": loss}
        if step:
            record["train_time_s"] = step * seconds_per_step
        out.append(record)
    return out


def test_crossing_interpolates_the_first_time_the_curve_comes_down_to_the_target():
    curve = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.0), (40, 2.0)]
    assert analysis.crossing(curve, 2.5) == pytest.approx(15.0)
    assert analysis.crossing(curve, 2.0) == 20  # reached exactly at an evaluation
    assert analysis.crossing(curve, 1.5) == pytest.approx(25.0)  # not the later crossing on the way back up
    assert analysis.crossing(curve, 0.5) is None
    assert analysis.crossing(curve, 6.0) == 0  # already there at the first point
    assert analysis.crossing([(0, 3.0), (10, 3.0), (20, 1.0)], 2.0) == pytest.approx(15.0)


def test_value_at_interpolates_and_holds_the_ends():
    curve = [(0, 4.0), (10, 2.0), (30, 1.0)]
    assert analysis.value_at(curve, 5) == pytest.approx(3.0)
    assert analysis.value_at(curve, 20) == pytest.approx(1.5)
    assert analysis.value_at(curve, 10) == 2.0
    assert (analysis.value_at(curve, -1), analysis.value_at(curve, 99)) == (4.0, 1.0)


def test_equal_loss_steps_between_budgets_and_bounds_outside_them():
    budgets = [(300, 2.0), (150, 2.4), (450, 1.8)]  # any order
    # Halfway in loss is halfway in log(steps): the geometric mean of the two budgets.
    assert analysis.equal_loss_steps(budgets, 2.2) == (pytest.approx((150 * 300) ** 0.5), "=")
    assert analysis.equal_loss_steps(budgets, 1.9) == (pytest.approx((300 * 450) ** 0.5), "=")
    assert analysis.equal_loss_steps(budgets, 2.0) == (pytest.approx(300), "=")
    assert analysis.equal_loss_steps(budgets, 2.5) == (150, "<=")  # even the smallest budget ends below it
    assert analysis.equal_loss_steps(budgets, 1.7) == (450, ">")  # even the largest does not reach it


def test_summarize_speedups_in_steps_and_time():
    scratch = {"steps": 100, "time": 50.0}  # scratch reaches its final loss 2.0 at step 100, after 50 s
    curve = [(0, 5.0), (20, 3.0), (40, 2.5), (60, 2.0), (80, 1.9), (100, 1.8)]
    summary = analysis.summarize("p2r", records(curve, 0.25), pseudo_steps=30, target=2.0, scratch=scratch)
    assert summary["steps_to_target"] == 60
    assert summary["real_steps_to_target"] == 30
    assert summary["speedup_steps"] == pytest.approx(100 / 60)
    assert summary["time_to_target_s"] == pytest.approx(15.0)
    assert summary["speedup_time"] == pytest.approx(50 / 15)
    assert summary["final_val_loss"] == 1.8 and summary["train_time_s"] == 25.0
    slow = analysis.summarize("slow", records([(0, 5.0), (100, 2.1)], 1.0), pseudo_steps=0, target=2.0, scratch=scratch)
    assert slow["steps_to_target"] is None and slow["speedup_steps"] is None and slow["speedup_time"] is None


def test_gaps_at_the_delink_after_it_and_at_the_end():
    scratch = {"val_curve": [(0, 5.0), (20, 3.0), (40, 2.0), (60, 1.5)]}
    run = {"pseudo_steps": 30, "val_curve": [(0, 5.0), (20, 3.2), (30, 2.8), (40, 2.4), (60, 1.6)]}
    gaps = analysis.gaps(run, scratch)
    assert gaps["at_delink"] == pytest.approx(2.8 - 2.5)  # scratch interpolated at step 30
    assert gaps["after_delink"] == pytest.approx(0.4)
    assert gaps["final"] == pytest.approx(0.1)


def test_scaled_preset_scales_every_step_count():
    preset = scaled(PRESETS["cpu"], steps=30, overrides={"hidden_size": "32"})
    assert preset["total_steps"] == 30
    assert preset["delink_steps"] == [5, 10, 15] and preset["carry_delink_step"] == 10
    assert preset["fields"]["warmup_steps"] == 2 and preset["fields"]["hidden_size"] == "32"
    assert PRESETS["cpu"]["total_steps"] == 300  # the preset itself is untouched
    runs = runs_of(preset)
    assert all(s["pseudo_steps"] + s["real_steps"] == 30 for s in runs.values())
    assert set(runs) == {
        "scratch",
        *(f"k2-{carry}-at10" for carry in ("reset", "copy", "scale")),
        "k2-scale-at5",
        "k2-scale-at15",
        "k1-scale-at10",
        "k2-scale-at10-samelr",
    }
    assert preset["fields"]["shared_lr_scale"] == "depth" and runs["k2-scale-at10-samelr"]["shared_lr_scale"] == "none"
    assert runs["k1-scale-at10"]["num_unique_layers"] == 1
    assert {s["real_steps"] for s in budget_runs(preset).values()} == {15, 45, 60}


def _seed(seed: int, scratch_final: float, p2r_final: float) -> dict:
    """One seed's records: scratch, a P2R run ending at `p2r_final`, scratch at half and 1.5x the budget."""
    scratch = [(0, 5.0), (50, 3.0), (100, scratch_final)]
    p2r = [(0, 5.0), (30, 3.6), (50, 3.2), (100, p2r_final)]
    runs = {"scratch": {"pseudo_steps": 0, "real_steps": 100}, "p2r": {"pseudo_steps": 30, "real_steps": 70}}
    budgets = {"scratch-x0.5": {"real_steps": 50}, "scratch-x1.5": {"real_steps": 150}}
    found = {
        "scratch": records(scratch, 0.5),
        "p2r": records(p2r, 0.5),
        "scratch-x0.5": records([(50, scratch_final + 0.4)], 0.5),
        "scratch-x1.5": records([(150, scratch_final - 0.2)], 0.5),
    }
    return analysis.compare_seed(seed, runs, found, budgets)


def test_compare_seed_and_aggregate():
    per_seed = [_seed(0, 2.0, 2.2), _seed(1, 2.1, 2.3)]
    first = per_seed[0]["runs"][1]
    # scratch ends at 2.0 after 100 steps and 2.4 after 50: ending at 2.2 takes it sqrt(50 * 100) steps.
    assert (first["equal_loss_steps"], first["equal_loss_bound"]) == (pytest.approx(5000**0.5), "=")
    assert first["speedup_equal_loss"] == pytest.approx(5000**0.5 / 100)
    assert first["speedup_steps"] is None
    assert first["gaps"]["final"] == pytest.approx(0.2)
    rows = analysis.aggregate(per_seed)
    assert [r["name"] for r in rows] == ["scratch", "p2r"]
    assert rows[0]["speedup_steps_mean"] == 1.0 and rows[0]["speedup_equal_loss_mean"] == [pytest.approx(1.0), "="]
    p2r = rows[1]
    assert p2r["delta_vs_scratch_mean"] == pytest.approx(0.2) and p2r["delta_vs_scratch_sd"] == pytest.approx(0.0)
    assert p2r["speedup_steps_mean"] is None  # not reached by every seed
    assert p2r["speedup_equal_loss_mean"] == [pytest.approx(0.7071, abs=1e-4), "="]
    assert p2r["gaps"]["final"]["mean"] == pytest.approx(0.2)


def test_aggregate_keeps_a_bound_and_drops_a_mean_of_opposite_bounds():
    below = _seed(0, 2.0, 2.9)  # worse than scratch at half the budget: <= 0.5x
    above = _seed(1, 2.0, 1.5)  # better than scratch at 1.5x the budget: > 1.5x
    exact = _seed(2, 2.0, 2.2)
    assert below["runs"][1]["equal_loss_bound"] == "<=" and above["runs"][1]["equal_loss_bound"] == ">"
    assert analysis.aggregate([below, exact])[1]["speedup_equal_loss_mean"] == [
        pytest.approx((0.5 + 0.5**0.5) / 2),
        "<=",
    ]
    assert analysis.aggregate([below, above])[1]["speedup_equal_loss_mean"] is None
    mixed = analysis.aggregate([above, exact])[1]
    assert mixed["speedup_steps_per_seed"] == [pytest.approx(100 / (50 + 50 * 1.2 / 1.7)), None]
    assert mixed["speedup_steps_mean"] is None and mixed["speedup_equal_loss_mean"] == [
        pytest.approx((1.5 + 0.5**0.5) / 2),
        ">",
    ]


def test_report_states_measured_figures(tmp_path):
    per_seed = [_seed(0, 2.0, 2.2), _seed(1, 2.1, 2.3)]
    preset = scaled(PRESETS["cpu"], steps=100)
    preset["budgets"] = [0.5, 1.5]
    machine = {
        "date": "2026-01-01T00:00:00+00:00",
        "cpu": "test cpu",
        "cpu_count": 2,
        "torch_threads": 1,
        "gpu": None,
        "torch": "x",
        "python": "y",
        "load_average_at_start": [0.1, 0.1, 0.1],
        "load_average_at_end": [0.2, 0.2, 0.2],
        "load_average_max": 0.3,
    }
    result = {
        "preset_name": "cpu",
        "preset": preset,
        "machine": machine,
        "jobs": 2,
        "seed_list": [0, 1],
        "wall_time_s": 90.0,
        "parameters": {"real": 1000, "pseudo": 400},
        "plot": "convergence.png",
        "runs": analysis.aggregate(per_seed),
        "seeds": per_seed,
    }
    report.write_report(result, tmp_path)
    text = (tmp_path / "convergence_carry.md").read_text()
    assert "total wall time 1.5 min" in text
    assert "same compute as a real step" in text
    assert "| p2r | 30 | 2.2500 | +0.2000 ± 0.0000 | not reached, not reached | - | - | 0.71x, 0.71x | 0.71x |" in text
    assert "no P2R run reached it with every seed" in text and "at 0.71x (mean over seeds): it misses" in text
    assert "| 50 | 2.4000 | 2.5000 |" in text  # scratch's loss per budget, per seed
    assert json.loads((tmp_path / "convergence_carry.json").read_text())["wall_time_s"] == 90.0


def test_verdict_against_the_target():
    # Both seeds reach scratch's final loss: 1.17x and 1.04x in steps; at equal loss one seed is beyond 1.5x budget.
    rows = analysis.aggregate([_seed(0, 2.0, 1.5), _seed(1, 2.0, 1.9)])
    text = " ".join(report._verdict(rows))
    assert "the best P2R run is p2r at 1.11x in steps (mean over seeds): it misses the target" in text
    assert "at >1.36x (mean over seeds): a bound, which does not tell whether it meets the target" in text
    rows = analysis.aggregate([_seed(0, 2.0, 0.5), _seed(1, 2.0, 0.6)])  # far below: 100 / 62.5 and 100 / 63.9
    assert "it meets the target" in " ".join(report._verdict(rows))


def test_growth_schedule_doubles_the_blocks_at_evenly_spaced_partial_delinks():
    name, schedule = sweeps.p2r_schedule(300, 150, 1, 8, grow=True)
    assert name == "k1-grow-at150"
    assert (schedule["partial_delink_steps"], schedule["partial_delink_blocks"]) == ([50, 100], [2, 4])
    assert sweeps.p2r_schedule(300, 100, 2, 8) == (
        "k2-at100",
        {"pseudo_steps": 100, "real_steps": 200, "num_unique_layers": 2, "optimizer_carry": "scale"},
    )
    argv = trainer_argv({**schedule, "num_hidden_layers": 8, "lr_scheduler": "wsd"})
    assert argv[argv.index("--partial_delink_blocks") + 1 : argv.index("--partial_delink_blocks") + 3] == ["2", "4"]
    config = parse_config(argv)  # the trainer accepts the schedule
    assert config.delink_schedule() == [(50, 2), (100, 4), (150, 8)]


def test_stage_times_and_state_per_stage():
    schedule = {"pseudo_steps": 40, "real_steps": 60, "partial_delink_steps": [20], "partial_delink_blocks": [4]}
    schedule["num_unique_layers"] = 2
    # 0.1 s a step for 20 steps, 0.2 s for 20, then 0.3 s.
    timeline = [(10, 1.0), (20, 2.0), (30, 4.0), (40, 6.0), (70, 15.0), (100, 24.0)]
    found = [{"step": step, "train_time_s": seconds} for step, seconds in timeline]
    stages = analysis.stage_times(found, schedule, depth=8)
    assert [(s["blocks"], s["steps"]) for s in stages] == [(2, 20), (4, 20), (8, 60)]
    assert [s["step_time_s"] for s in stages] == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)]
    scratch = analysis.stage_times(found, {"pseudo_steps": 0, "real_steps": 100}, depth=8)
    assert scratch == [{"blocks": 8, "steps": 100, "step_time_s": pytest.approx(0.24)}]


def _group(corpus: str, depth: int, p2r_final: float) -> dict:
    per_seed = [_seed(seed, 2.0, p2r_final) for seed in (0, 1)]
    rows = analysis.aggregate(per_seed)
    schedules = {"scratch": {"pseudo_steps": 0, "real_steps": 100}, "p2r": {"pseudo_steps": 30, "real_steps": 70}}
    for row in rows:
        row["schedule"] = schedules[row["name"]]
        blocks = [depth] if row["name"] == "scratch" else [1, depth]
        row["stages"] = [
            {"blocks": b, "steps": 50, "state_bytes": 16 * (100 + 10 * b), "step_time_s": 0.1} for b in blocks
        ]
    name = f"{corpus}-L{depth}-wsd"
    return {
        "name": name,
        "corpus": corpus,
        "depth": depth,
        "scheduler": "wsd",
        "seeds": [0, 1],
        "rows": rows,
        "per_seed": per_seed,
    }


def test_merge_sweep_keeps_earlier_groups_and_the_sweep_page_names_the_best(tmp_path):
    invocation = {
        "command": "c",
        "machine": {
            "date": "d",
            "cpu": "cpu",
            "cpu_count": 2,
            "torch_threads": 1,
            "torch": "t",
            "load_average_at_start": [1.0],
            "load_average_max": 2.0,
            "load_average_at_end": [1.0],
        },
        "jobs": 2,
        "seed_list": [0, 1],
        "ran": 4,
        "reused_runs": 0,
        "wall_time_s": 60.0,
    }
    preset = scaled(PRESETS["cpu"], steps=100)

    def result(groups):
        return {
            "sweep": "depth",
            "preset": preset,
            "corpora": ["stdlib", "prose"],
            "invocations": [invocation],
            "groups": groups,
        }

    first = result([_group("stdlib", 8, 1.5), _group("prose", 8, 1.9)])
    merged = sweeps.merge_sweep(first, result([_group("stdlib", 16, 1.5), _group("prose", 16, 1.5)]))
    assert [g["name"] for g in merged["groups"]] == ["stdlib-L8-wsd", "stdlib-L16-wsd", "prose-L8-wsd", "prose-L16-wsd"]
    assert len(merged["invocations"]) == 2
    (tmp_path / "convergence_depth.json").write_text(json.dumps(merged))
    text = sweep_report.write_sweep_report(tmp_path).read_text()
    # p2r ending at 1.5 reaches scratch's final 2.0 at step 50 + 50 * 1.2 / 1.7: 100 / 85.3 = 1.17x on both seeds;
    # ending at 1.9 (prose, L=8): 1.04x.
    assert "**Which configuration to pick**: L=16 wsd p2r" in text
    assert "prose: 1.17x, 1.17x (mean 1.17x); stdlib: 1.17x, 1.17x (mean 1.17x)" in text
    assert "It does not meet (worst seed 1.17x) the 1.5x target on every corpus and seed." in text
    assert (
        "does not pay** (some seed below 1.1x, or never at scratch's final loss): L=8 wsd p2r on prose (1.04x" in text
    )
    assert "| prose | 8 | wsd | p2r | 30 |" in text
    assert "| stdlib | 16 | wsd | p2r | 1: 50, 16: 50 | 0.0 / 0.0 | 0.42 / 1.00 | 100 / 100 | 100 |" in text


def test_offload_gain_counts_the_pseudo_steps_at_full_speed():
    # Scratch: 300 steps, each 2x slower offloaded; P2R: 100 pseudo steps at full speed + 80 offloaded real steps.
    assert analysis.offload_gain(300, 180, 100, 2.0) == pytest.approx(600 / 260)
    assert analysis.offload_gain(300, 180, 100, 1.0) == pytest.approx(300 / 180)  # no offload: the speed-up in steps
    assert analysis.offload_gain(300, 90, 100, 4.0) == pytest.approx(1200 / 90)  # reached within the pseudo stage
