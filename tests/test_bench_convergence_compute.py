"""benchmarks/convergence/compute.py (issue 39's compute-to-loss study): the recipes' schedules, the equal-compute
step counts, the comparison by FLOPs and the page, on synthetic records (no training)."""

import argparse

import pytest

from benchmarks.convergence import compute
from benchmarks.convergence.runs import PRESETS, trainer_argv
from hf_p2r.training import parse_config


def flops_per_token(depth: int) -> float:
    return 10.0 * depth + 5.0  # a layer costs 10, the head 5


def test_every_recipe_is_a_valid_trainer_schedule_ending_at_the_real_model():
    book = compute.recipes(8)
    assert list(book)[:2] == ["scratch", "p2r-1-2-4-8"]
    assert {"bu-1to8-at80", "gstack-2to8-at50", "hybrid-4x1-at50", "gstack-2to8-at50-fp"} <= set(book)
    fields = {**PRESETS["cpu"]["fields"], **compute.STUDY_FIELDS}
    for recipe in book.values():
        assert recipe.stages[0][0] == 0.0 and recipe.stages[-1][1:] == (8, 8)
        schedule = compute.schedule_of(recipe, 300)
        config = parse_config(trainer_argv({**fields, **schedule}))
        assert config.stages.total_steps == 300
        # the trainer's stages are the recipe's: (step, depth, blocks) after each delink
        expected = [(round(300 * start), d, k) for start, d, k in recipe.stages[1:]]
        assert config.stage_schedule() == expected


def test_the_recipes_schedules_name_the_depths_and_blocks():
    book = compute.recipes(8)
    assert compute.schedule_of(book["scratch"], 300) == {"pseudo_steps": 0, "real_steps": 300}
    assert compute.schedule_of(book["bu-1to8-at80"], 1000) == {
        "pseudo_steps": 800,
        "real_steps": 200,
        "num_unique_layers": 1,
        "pseudo_num_hidden_layers": 1,
        "optimizer_carry": "reset",
        "growth": "stack",
    }
    hybrid = compute.schedule_of(book["hybrid-4x1-at50"], 600)
    assert (hybrid["pseudo_num_hidden_layers"], hybrid["num_unique_layers"]) == (4, 1)
    assert (hybrid["partial_delink_steps"], hybrid["partial_delink_blocks"]) == ([150], [2])
    assert "partial_delink_depths" not in hybrid  # constant depth until the growth
    p2r = compute.schedule_of(book["p2r-1-2-4-8"], 300)
    assert (p2r["partial_delink_steps"], p2r["partial_delink_blocks"], p2r["pseudo_steps"]) == ([33, 67], [2, 4], 100)
    assert "pseudo_num_hidden_layers" not in p2r


def test_equal_compute_steps_spend_scratchs_flops():
    book = compute.recipes(8)
    assert compute.solve_steps(book["scratch"], 300, flops_per_token) == 300
    assert compute.solve_steps(book["p2r-1-2-4-8"], 300, flops_per_token) == 300  # full depth: same cost per step
    # 80% of the steps at depth 1 (15), 20% at 8 (85): mean 29 per step against scratch's 85
    assert compute.solve_steps(book["bu-1to8-at80"], 300, flops_per_token) == round(300 * 85 / 29)
    assert compute.solve_steps(book["gstack-2to8-at50-tok"], 300, flops_per_token) == 300  # equal tokens


def test_a_budget_below_one_spends_that_share_of_scratchs_flops():
    """`-b50`: half of scratch's FLOPs, the recipe's stages (and so its WSD decay, the last fifth of its own steps)
    placed in its own, fewer steps."""
    book = compute.recipes(8)
    assert {"scratch-b50", "bu-1to8-at80-b50", "bu-1to8-at80-b70", "gstack-2to8-at50-b50"} <= set(book)
    assert book["bu-1to8-at80-b70"].budget == 0.7
    half, full = book["bu-1to8-at80-b50"], book["bu-1to8-at80"]
    assert (half.budget, full.budget) == (0.5, 1.0) and (half.stages, half.fields) == (full.stages, full.fields)
    assert compute.solve_steps(book["scratch-b50"], 300, flops_per_token) == 150
    steps = compute.solve_steps(half, 300, flops_per_token)
    assert steps == round(0.5 * 300 * 85 / 29)
    # the FLOPs those steps spend: 80% at depth 1 (15 a token), 20% at 8 (85), against scratch's 300 at 85
    spent = (0.8 * 15 + 0.2 * 85) * steps
    assert spent / (300 * 85) == pytest.approx(0.5, abs=0.01)
    schedule = compute.schedule_of(half, steps)
    assert (schedule["pseudo_steps"], schedule["real_steps"]) == (round(0.8 * steps), steps - round(0.8 * steps))
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"budget": 0.5, "equal_tokens": True}):
        with pytest.raises(ValueError, match="budget"):
            compute.Recipe("x", "x", ((0.0, 8, 8),), **bad)


def records(points: list[tuple[int, float]], flops_per_step: list[float], tokens_per_step: int = 10) -> list[dict]:
    """metrics records: a validation loss at each (step, loss), cumulative tokens and flops (step i costs
    flops_per_step[i])."""
    out = []
    for step, loss in points:
        out.append(
            {"step": step, "val_loss": loss, "tokens": step * tokens_per_step, "flops": sum(flops_per_step[:step])}
        )
    return out


def test_compare_measures_compute_to_scratchs_final_loss():
    scratch = records([(0, 5.0), (50, 3.0), (100, 2.0)], [4.0] * 100)  # 400 FLOPs in all, ends at 2.0
    # cheap steps (1 FLOP) for 200 steps then 4: reaches 2.0 at step 200 (200 FLOPs), ends at 1.8
    grow_flops = [1.0] * 200 + [4.0] * 50
    grow = records([(0, 5.0), (100, 3.0), (200, 2.0), (250, 1.8)], grow_flops)
    for record in grow:
        record["num_hidden_layers"] = 2 if record["step"] < 200 else 8  # grown at step 200
    result = compute.compare({"scratch": scratch, "grow": grow})
    assert result["target"] == 2.0 and result["scratch"] == {"flops": 400.0, "tokens": 1000, "steps": 100}
    base, row = result["runs"]
    assert base["speedup_flops"] == 1.0 and base["budget_ratio"] == 1.0
    assert row["flops_to_target"] == 200.0 and row["speedup_flops"] == 2.0
    assert row["depth_at_target"] == 8  # reached by the grown model
    # the last evaluation at depth 2 (step 100, 100 FLOPs of scratch's 400) and the first at 8 (step 200)
    assert row["growth"] == {"depth_before": 2, "flops_share": 0.25, "loss_before": 3.0, "loss_after": 2.0}
    assert base["growth"] is None  # scratch never grows
    assert (row["tokens_to_target"], row["steps_to_target"]) == (2000, 200)
    assert row["budget_ratio"] == 1.0 and row["delta_vs_scratch"] == pytest.approx(-0.2)
    assert row["loss_at_scratch_tokens"] == 3.0  # after scratch's 1000 tokens, mid-run
    assert row["decay"] is None  # no learning rate logged
    # logged learning rates: warm-up to 1e-3 at step 20, held to step 220, then decaying (logged every 10 steps)
    logged = [
        {"step": i, "lr": 1e-3 * min(1.0, i / 20) * (1.0 if i < 220 else (250 - i) / 30), "flops": sum(grow_flops[:i])}
        for i in range(10, 251, 10)
    ]
    decay = compute.compare({"scratch": scratch, "grow": sorted(grow + logged, key=lambda r: r["step"])})
    # the first logged fall from the peak is step 230 (200 + 30 x 4 = 320 FLOPs of scratch's 400); the last evaluation
    # before it, step 200
    assert decay["runs"][1]["decay"] == {"flops_share": 320 / 400, "loss": 2.0}
    slow = records([(0, 5.0), (100, 2.5)], [4.0] * 100)
    assert compute.compare({"scratch": scratch, "slow": slow})["runs"][1]["speedup_flops"] is None


def _group(name: str, speedups: dict) -> dict:
    return {"name": name, "seeds": [0, 1], "speedups": speedups}


def test_the_recommendation_is_the_best_worst_seed_among_recipes_run_everywhere():
    groups = [
        _group("stdlib-L8-adamw", {"scratch": [1, 1], "a": [2.5, 1.9], "b": [2.2, 2.1], "c": [9, 9], "a-tok": [5, 5]}),
        _group("prose-L8-adamw", {"scratch": [1, 1], "a": [3.0, 3.0], "b": [2.4, None]}),
    ]
    best = compute.recommend(groups)  # c ran in one group only; b never reached at one seed: worst 0
    assert best["name"] == "a" and best["worst"] == 1.9
    assert best["by_group"] == {"stdlib-L8-adamw": [2.5, 1.9], "prose-L8-adamw": [3.0, 3.0]}
    assert compute.recommend([_group("x", {"scratch": [1.0]})]) is None


def test_the_page_says_what_ran_what_did_not_and_the_verdict():
    preset = PRESETS["cpu"]
    scratch = records([(0, 5.0), (50, 3.0), (100, 2.0)], [4.0] * 100)
    grow = records([(0, 5.0), (100, 3.0), (200, 2.0), (250, 1.8)], [1.0] * 200 + [4.0] * 50)
    seed = {"seed": 0, **compute.compare({"scratch": scratch, "gstack-2to8-at50": grow})}
    group = {"name": "stdlib-L8-adamw", "corpus": "stdlib", "optimizer": "adamw", "depth": 8, "seeds": [0]}
    group.update(per_seed=[seed], speedups={"scratch": [1.0], "gstack-2to8-at50": [2.0]})
    group["ran"] = {"scratch": [0], "gstack-2to8-at50": [0]}
    book = compute.recipes(8)
    machine = {
        "date": "2026-11-28T06:00:00+00:00",
        "cpu": "test cpu",
        "cpu_count": 2,
        "torch_threads": 1,
        "torch": "x",
        "load_average_at_start": [3.0, 3.0, 3.0],
        "load_average_at_end": [4.0, 4.0, 4.0],
        "load_average_max": 6.5,
    }
    result = {
        "preset": preset,
        "plan": {
            "recipes": {n: {"what": r.what, "stages": r.stages, "fields": r.fields} for n, r in book.items()},
            "corpora": ["stdlib", "prose"],
            "optimizers": ["adamw", "muon"],
            "seeds": [0, 1, 2],
        },
        "invocations": [{"command": "python scripts/bench_convergence.py --compute", "machine": machine, "ran": 2}],
        "groups": [group],
        "recommended": compute.recommend([group]),
    }
    result["invocations"][0]["wall_time_s"] = 120.0
    page = compute.markdown(result)
    assert "2 runs in 2.0 min; load average 3.0 at the start, 4.0 at the end, 6.5 at most" in page
    assert "- stdlib-L8-adamw, seeds [0]: scratch, gstack-2to8-at50." in page
    assert "Not run (no scratch run, so nothing to compare): stdlib-L8-adamw seed 1," in page
    assert "prose-L8-muon seed 2." in page
    assert "Recipes not run in any group: bu-1to8-at60," in page
    assert (
        "| gstack-2to8-at50 | 0 | 1.8000 | -0.2000 | 1.00 | 250 | 2,500 | 400 | 200 | 2.00x | - | - | +1.0000 |" in page
    )
    assert "**gstack-2to8-at50**, worst 2.00x over 1 group(s) and seed(s) [0]: it meets the 2x target" in page
    assert "the target is not shown met for them" in page
    assert "before its growth" not in page  # reached at depth 8 (or, here, no depth recorded)
    seed["runs"][1]["depth_at_target"] = 2
    seed["runs"][1]["growth"] = {"flops_share": 0.25, "loss_before": 3.0, "loss_after": 2.0}
    assert "| 2.00x | 2 | 3.0000 -> 2.0000 (25%) | +1.0000 |" in compute.markdown(result)
    assert "gstack-2to8-at50 reached scratch's final loss before its growth, with its shallow model, in " in (
        compute.markdown(result)
    )
    group["speedups"]["gstack-2to8-at50"] = [1.5]
    seed["runs"][1].update(speedup_flops=1.5, flops_to_target=400 / 1.5)
    result["recommended"] = compute.recommend([group])
    page = compute.markdown(result)
    assert "misses the 2x target by 0.50x at its worst" in page
    # the measured reason, from the run's own curve: FLOPs before the growth, the losses around it, the crossing
    assert (
        "- stdlib-L8-adamw seed 0: 1.50x: 25% of scratch's FLOPs went to the shallow start, which ended at "
        "3.0000 (+1.0000 from scratch's final 2.0000); at the first evaluation after the growth the loss was 2.0000 "
        "(-1.0000); the grown model reached scratch's final loss at 67% of scratch's FLOPs (50% or less is 2x)."
    ) in page
    assert "at some seeds only" not in page and "Recipes run at some seeds only" not in page
    # with the run's learning-rate decay measured, the reason says where it began and the loss then
    seed["runs"][1]["decay"] = {"flops_share": 0.6, "loss": 2.1}
    assert (
        "(-1.0000); its learning rate began to decay at 60% of scratch's FLOPs, the loss then 2.1000 (+0.1000); the "
        "grown model reached scratch's final loss at 67%"
    ) in compute.markdown(result)


def test_the_page_shows_a_recipe_run_at_some_seeds_only():
    """A recipe finished at seed 0 of a group whose scratch ran at seeds 0 and 1 is no candidate for the
    recommendation, yet the page lists it as run (not among the recipes never run), gives each of its speed-ups, says
    whether it beats the recommended recipe's worst on every run it has, and where it does, why each run misses 2x."""
    preset = PRESETS["cpu"]
    scratch = records([(0, 5.0), (50, 3.0), (100, 2.0)], [4.0] * 100)
    grow = records([(0, 5.0), (100, 3.0), (200, 2.0), (250, 1.8)], [1.0] * 200 + [4.0] * 50)
    for record in grow:
        record["num_hidden_layers"] = 2 if record["step"] < 200 else 8
    late = records([(0, 5.0), (100, 2.5), (300, 2.0)], [1.0] * 100 + [4.0] * 75)  # 2.0 at 400 FLOPs: 1.00x
    for record in late:
        record["num_hidden_layers"] = 1 if record["step"] < 300 else 8
    seeds = [
        {"seed": 0, **compute.compare({"scratch": scratch, "bu-1to8-at80": late, "gstack-2to8-at50": grow})},
        {"seed": 1, **compute.compare({"scratch": scratch, "bu-1to8-at80": late})},
    ]
    group = {"name": "stdlib-L8-adamw", "corpus": "stdlib", "optimizer": "adamw", "depth": 8, "seeds": [0, 1]}
    group.update(per_seed=seeds, speedups={"scratch": [1.0, 1.0], "bu-1to8-at80": [1.0, 1.0]})
    group["ran"] = {"scratch": [0, 1], "bu-1to8-at80": [0, 1], "gstack-2to8-at50": [0]}
    assert seeds[0]["runs"][2]["speedup_flops"] == 2.0 and seeds[0]["runs"][1]["speedup_flops"] == 1.0
    book = compute.recipes(8)
    result = {
        "preset": preset,
        "plan": {
            "recipes": {n: {"what": r.what, "stages": r.stages, "fields": r.fields} for n, r in book.items()},
            "corpora": ["stdlib"],
            "optimizers": ["adamw"],
            "seeds": [0, 1],
        },
        "invocations": [],
        "groups": [group],
        "recommended": compute.recommend([group]),
    }
    assert result["recommended"]["name"] == "bu-1to8-at80"  # gstack lacks seed 1: no candidate
    page = compute.markdown(result)
    assert (
        "- stdlib-L8-adamw, seeds [0, 1]: scratch, bu-1to8-at80; at some seeds only: gstack-2to8-at50 (seed 0)." in page
    )
    never = page.split("Recipes not run in any group: ")[1].split(".\n")[0].split(", ")
    assert "gstack-2to8-at50" not in never and "bu-1to8-at60" in never
    assert (
        "- gstack-2to8-at50: stdlib-L8-adamw seed 0 2.00x (bu-1to8-at80: 1.00x); above bu-1to8-at80's worst (1.00x) at "
        "every run it has, and not below it at the same group and seed."
    ) in page
    assert "  - stdlib-L8-adamw seed 0: 2.00x" not in page  # it meets 2x there: no reason to give
    seeds[0]["runs"][2].update(speedup_flops=1.5, flops_to_target=400 / 1.5)
    page = compute.markdown(result)
    assert (
        "  - stdlib-L8-adamw seed 0: 1.50x: 25% of scratch's FLOPs went to the 2-layer start, which ended at 3.0000"
    ) in page
    # above the recommended recipe's worst, yet below it at the same seed: the page says both
    seeds[0]["runs"][1].update(speedup_flops=1.8, flops_to_target=400 / 1.8)
    assert (
        "- gstack-2to8-at50: stdlib-L8-adamw seed 0 1.50x (bu-1to8-at80: 1.80x); above bu-1to8-at80's worst (1.00x) "
        "at every run it has, below it at the same group and seed in 1 of 1."
    ) in compute.markdown(result)
    seeds[0]["runs"][1].update(speedup_flops=1.0, flops_to_target=400.0)
    seeds[0]["runs"][2].update(speedup_flops=0.9, flops_to_target=400 / 0.9)
    page = compute.markdown(result)
    assert (
        "- gstack-2to8-at50: stdlib-L8-adamw seed 0 0.90x (bu-1to8-at80: 1.00x); not above bu-1to8-at80's worst" in page
    )
    assert "  - stdlib-L8-adamw seed 0:" not in page


def test_an_optimizer_can_run_its_own_scratch_budget(tmp_path):
    """--optimizer-steps muon=400: the Muon groups' scratch runs 400 steps (their warm-up and evaluation scaled alike)
    and every recipe spends that scratch run's FLOPs; the AdamW groups keep --steps."""
    from benchmarks.convergence.cli import _optimizer_steps
    from benchmarks.convergence.runs import scaled

    preset = scaled(PRESETS["cpu"], 1000)
    steps = compute.optimizer_steps(preset, [_optimizer_steps("muon=400")])
    assert steps == {"adamw": 1000, "muon": 400}
    groups = compute.groups_of(["stdlib"], ["adamw", "muon"], 8, steps)
    runs = compute.study_runs(preset, groups, ["bu-1to8-at80"], [0], tmp_path / "compute")
    configs = {key: parse_config(argv) for key, (_, argv) in runs.items()}
    adamw, muon = configs["stdlib-L8-adamw", 0, "scratch"], configs["stdlib-L8-muon", 0, "scratch"]
    assert (adamw.stages.total_steps, muon.stages.total_steps) == (1000, 400)
    assert (adamw.schedule.warmup_steps, muon.schedule.warmup_steps) == (67, 27)  # 20 of 300, scaled
    # the recipe spends its own group's scratch FLOPs: the same multiple of scratch's steps in both
    bu = {opt: runs[f"stdlib-L8-{opt}", 0, "bu-1to8-at80"][0] for opt in ("adamw", "muon")}
    assert abs(bu["muon"] - bu["adamw"] * 400 / 1000) <= 1 and bu["adamw"] > 3 * 1000
    assert configs["stdlib-L8-muon", 0, "bu-1to8-at80"].optim.optimizer == "muon"
    for bad in ("sgd=400", "muon=1", "muon", "muon=x"):  # the command line refuses these in one line
        with pytest.raises(argparse.ArgumentTypeError, match="OPTIMIZER=STEPS"):
            _optimizer_steps(bad)


def test_the_page_gives_each_recipes_budget_and_each_runs_share_of_scratchs_flops():
    """The recipe table states each recipe's budget (equal-token runs: scratch's steps), and a half-budget run's row
    its measured FLOPs / scratch's (0.50): reaching scratch's final loss within them is a speed-up of 2x or more, and
    a run that does not reach it shows the loss it ended at."""
    scratch = records([(0, 5.0), (50, 3.0), (100, 2.0)], [4.0] * 100)  # 400 FLOPs
    half = records([(0, 5.0), (100, 2.5), (150, 1.9)], [1.0] * 100 + [2.0] * 50)  # 200 FLOPs, 2.0 at 100 + 100 x 5/6
    short = records([(0, 5.0), (100, 2.5), (150, 2.1)], [1.0] * 100 + [2.0] * 50)  # 200 FLOPs, never at 2.0
    control = records([(0, 5.0), (50, 2.3)], [4.0] * 50)  # scratch for half its FLOPs: never at 2.0, ends higher
    full = records([(0, 5.0), (100, 2.6), (250, 1.8)], [1.0] * 200 + [4.0] * 50)  # the recipe on scratch's 400 FLOPs
    both = {"scratch": scratch, "bu-1to8-at80-b50": half, "scratch-b50": control, "bu-1to8-at80": full}
    seeds = [
        {"seed": 0, **compute.compare(both)},
        {"seed": 1, **compute.compare({"scratch": scratch, "bu-1to8-at80-b50": short, "scratch-b50": control})},
    ]
    group = {"name": "stdlib-L8-adamw", "corpus": "stdlib", "optimizer": "adamw", "depth": 8, "seeds": [0, 1]}
    # at the half-budget run's 200 FLOPs: the full-budget run mid-schedule (2.6 at 100 FLOPs, 1.8 at 400) and
    # scratch's model on the same budget (its end); scratch-b50 against scratch at its own 200 FLOPs (step 50)
    rows = {row["name"]: row for row in seeds[0]["runs"]}
    assert rows["bu-1to8-at80-b50"]["at_same_flops"] == {
        "bu-1to8-at80": pytest.approx(2.6 - 0.8 / 3),
        "scratch-b50": 2.3,
    }
    assert rows["scratch-b50"]["at_same_flops"] == {"scratch": 3.0} and "at_same_flops" not in rows["bu-1to8-at80"]
    assert seeds[1]["runs"][1]["at_same_flops"] == {"scratch-b50": 2.3}  # no full-budget run at seed 1
    reached = seeds[0]["runs"][1]["speedup_flops"]
    assert reached == pytest.approx(400 / (100 + 100 * 5 / 6)) and seeds[1]["runs"][1]["speedup_flops"] is None
    speedups = {"scratch": [1.0, 1.0], "scratch-b50": [None, None], "bu-1to8-at80-b50": [reached, None]}
    group.update(per_seed=seeds, speedups=speedups, ran=dict.fromkeys(speedups, [0, 1]))
    result = {
        "preset": PRESETS["cpu"],
        "plan": {"recipes": compute.described(compute.recipes(8)), "corpora": ["stdlib"], "optimizers": ["adamw"]},
        "invocations": [],
        "groups": [group],
        "recommended": compute.recommend([group]),
    }
    result["plan"]["seeds"] = [0, 1]
    page = compute.markdown(result)
    recipes = page.split("## What ran")[0].splitlines()
    table = {line.split(" | ")[0][2:]: line.split(" | ")[-1] for line in recipes if line.startswith("| ")}
    assert table["bu-1to8-at80"] == "100% |" and table["bu-1to8-at80-b50"] == "50% |"
    assert table["scratch-b50"] == "50% |" and table["bu-1to8-at80-tok"] == "scratch's steps |"
    assert "| bu-1to8-at80-b50 | 0 | 1.9000 | -0.1000 | 0.50 | 150 | 1,500 | 200 | 183 | 2.18x |" in page
    assert "| bu-1to8-at80-b50 | 1 | 2.1000 | +0.1000 | 0.50 | 150 | 1,500 | 200 | - | not reached |" in page
    assert (
        "worst not reached over 1 group(s) and seed(s) [0, 1]: it does not reach scratch's final loss at its worst "
        "(its final loss is in the table)."
    ) in page
    # the recipes never reaching scratch's loss at some seed, closest first: the half-budget growth run, then scratch's
    verdict = page.split("## Verdict")[1]
    growth = "- bu-1to8-at80-b50: worst not reached (2 group-seeds); final loss at most +0.1000 from scratch's "
    control = "- scratch-b50: worst not reached (2 group-seeds); final loss at most +0.3000 from scratch's"
    assert growth + "(stdlib-L8-adamw seed 1)" in verdict and control in verdict
    assert verdict.index(growth) < verdict.index(control)
    assert (
        "- bu-1to8-at80-b50, stdlib-L8-adamw seed 0: final 1.9000 at 50% of scratch's FLOPs; there: bu-1to8-at80 "
        "2.3333, scratch-b50 2.3000\n"
    ) in verdict
    assert "- scratch-b50, stdlib-L8-adamw seed 1: final 2.3000 at 50% of scratch's FLOPs; there: scratch 3.0000\n" in (
        verdict
    )
