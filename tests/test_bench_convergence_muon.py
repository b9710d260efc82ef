"""The convergence benchmark's optimizer axis (issue 27): the muon sweep trains the recommended configuration and
scratch under `optimizer: muon`, and the page compares its speed-up with the best sweep's AdamW runs."""

from benchmarks.convergence import sweep_report, sweeps
from benchmarks.convergence.runs import PRESETS, scaled, trainer_argv
from hf_p2r.training import parse_config

from .test_bench_convergence import _group


def test_the_muon_sweep_runs_growth_from_one_block_and_scratch_under_muon():
    preset = scaled(PRESETS["cpu"], steps=300)
    groups = sweeps.sweep_groups("muon", preset, ["stdlib", "prose"], sweeps.SWEEP_DEFAULTS["muon"])
    assert [g["name"] for g in groups] == ["stdlib-L8-cosine-muon", "prose-L8-cosine-muon"]
    for group in groups:
        assert group["fields"]["optimizer"] == "muon"
        assert list(group["runs"]) == ["scratch", "k1-grow-at100"]
        config = parse_config(trainer_argv({**preset["fields"], **group["fields"], **group["runs"]["k1-grow-at100"]}))
        assert config.train.optimizer == "muon"
        assert config.delink_schedule() == [(33, 2), (67, 4), (100, 8)]
    # The other sweeps keep AdamW, the trainer's default: their runs are the ones already measured.
    best = sweeps.sweep_groups("best", preset, ["stdlib"], sweeps.SWEEP_DEFAULTS["best"])
    assert best[0]["name"] == "stdlib-L8-cosine" and "optimizer" not in best[0]["fields"]


def _sweep(name: str, groups: list[dict]) -> dict:
    return {"sweep": name, "corpora": ["stdlib"], "groups": groups}


def test_the_page_compares_muons_speed_up_with_adamws_seed_by_seed():
    # p2r ending at 1.5 reaches scratch's 2.0 at 1.17x on both seeds, at 1.9 at 1.04x (test_bench_convergence).
    muon = _group("stdlib", 8, 1.5)
    muon["name"] += "-muon"
    lines = sweep_report._muon_findings(
        {"best": _sweep("best", [_group("stdlib", 8, 1.9)]), "muon": _sweep("muon", [muon])}
    )
    assert len(lines) == 1
    assert "stdlib (L=8, wsd, p2r): Muon 1.17x, 1.17x (mean 1.17x;" in lines[0]
    assert "against AdamW 1.04x, 1.04x (mean 1.04x;" in lines[0]
    assert lines[0].endswith("P2R's speed-up under Muon against AdamW's: stdlib grows.")
    same = sweep_report._muon_findings(
        {"best": _sweep("best", [_group("stdlib", 8, 1.5)]), "muon": _sweep("muon", [muon])}
    )
    assert same[0].endswith("stdlib holds (the seeds overlap).")
    assert sweep_report._muon_findings({"muon": _sweep("muon", [muon])}) == []  # nothing to compare with
