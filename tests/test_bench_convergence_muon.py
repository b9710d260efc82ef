"""The convergence benchmark's optimizer axis (issue 27): the muon sweep trains the recommended configuration and
scratch under `optimizer: muon` and under AdamW, together, and the page compares the two speed-ups seed by seed."""

from benchmarks.convergence import sweep_report, sweeps
from benchmarks.convergence.runs import PRESETS, scaled, trainer_argv
from hf_p2r.training import parse_config

from .test_bench_convergence import _group


def test_the_muon_sweep_runs_growth_from_one_block_and_scratch_under_each_optimizer():
    preset = scaled(PRESETS["cpu"], steps=300)
    groups = sweeps.sweep_groups("muon", preset, ["stdlib", "prose"], sweeps.SWEEP_DEFAULTS["muon"])
    names = ["stdlib-L8-cosine-adamw", "stdlib-L8-cosine-muon", "prose-L8-cosine-adamw", "prose-L8-cosine-muon"]
    assert [g["name"] for g in groups] == names
    for group in groups:
        assert group["fields"]["optimizer"] == group["optimizer"] == group["name"].rsplit("-", 1)[1]
        assert list(group["runs"]) == ["scratch", "k1-grow-at100"]
        config = parse_config(trainer_argv({**preset["fields"], **group["fields"], **group["runs"]["k1-grow-at100"]}))
        assert config.train.optimizer == group["optimizer"]
        assert config.delink_schedule() == [(33, 2), (67, 4), (100, 8)]
    # The other sweeps leave the optimizer unset (AdamW, the trainer's default): their runs are the ones measured.
    best = sweeps.sweep_groups("best", preset, ["stdlib"], sweeps.SWEEP_DEFAULTS["best"])
    assert best[0]["name"] == "stdlib-L8-cosine" and "optimizer" not in best[0]["fields"]


def _pair(muon_final: float, adamw_final: float) -> dict:
    groups = []
    for optimizer, final in (("adamw", adamw_final), ("muon", muon_final)):
        group = _group("stdlib", 8, final)
        group.update(name=f"{group['name']}-{optimizer}", optimizer=optimizer)
        groups.append(group)
    return {"muon": {"sweep": "muon", "corpora": ["stdlib"], "groups": groups}}


def test_the_page_compares_muons_speed_up_with_adamws_seed_by_seed():
    # p2r ending at 1.5 reaches scratch's 2.0 at 1.17x on both seeds, at 1.9 at 1.04x (test_bench_convergence).
    [line] = sweep_report._muon_findings(_pair(muon_final=1.5, adamw_final=1.9))
    assert "stdlib (L=8, wsd, p2r): Muon 1.17x, 1.17x (mean 1.17x;" in line
    assert "against AdamW 1.04x, 1.04x (mean 1.04x;" in line
    assert line.endswith("P2R's speed-up under Muon against AdamW's: stdlib grows.")
    assert sweep_report._muon_findings(_pair(1.9, 1.5))[0].endswith("stdlib shrinks.")
    assert sweep_report._muon_findings(_pair(1.5, 1.5))[0].endswith("stdlib holds (the seeds overlap).")
    assert sweep_report._muon_findings({}) == []
