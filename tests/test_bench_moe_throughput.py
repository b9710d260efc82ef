"""benchmarks/moe_throughput.py end to end on its tiny preset: the report is consistent with what it measured."""

import json
import statistics

import pytest

from benchmarks import moe_throughput as bench
from benchmarks.harness import REPO

from .bench_report import TINY_THROUGHPUT, bench_report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    return bench_report(bench, tmp_path_factory, "moe_throughput", TINY_THROUGHPUT)


def test_ratios_follow_from_the_measured_rates(report):
    result, markdown = report
    rates = result["tokens_per_s"]
    assert set(rates) == {"mixtral", "p2r_moe_real", "p2r_moe_pseudo"}
    for key, (a, b) in {
        "ratio_real_vs_mixtral": ("p2r_moe_real", "mixtral"),
        "ratio_pseudo_vs_real": ("p2r_moe_pseudo", "p2r_moe_real"),
    }.items():
        assert result[key]["median"] == pytest.approx(statistics.median(x / y for x, y in zip(rates[a], rates[b])))
    assert markdown == bench.render_markdown(result)
    assert result["config"]["experts_implementation"] == "grouped_mm"


def test_training_state_bytes_match_mixtral_and_the_expected_ratio(report):
    result, _ = report
    state = result["training_state_bytes"]
    assert state["mixtral"] == state["p2r_moe_real"], "same dimensions, same tensors"
    ratio = result["state_ratio_pseudo_vs_real"]
    assert ratio["measured"] == pytest.approx(ratio["expected"], rel=1e-3)


def test_committed_markdown_is_the_render_of_the_committed_json():
    benchmarks = REPO / "benchmarks"
    result = json.loads((benchmarks / "moe_throughput.json").read_text())
    assert (benchmarks / "moe_throughput.md").read_text() == bench.render_markdown(result)
