"""benchmarks/moe_throughput.py end to end on its tiny preset: the report is consistent with what it measured."""

import json

import pytest

from benchmarks import moe_throughput as bench
from benchmarks.harness import REPO

from .bench_report import TINY_THROUGHPUT, assert_ratios_follow_from_the_rates, report_fixture

report = report_fixture(bench, "moe_throughput", TINY_THROUGHPUT)


def test_ratios_follow_from_the_measured_rates(report):
    result, markdown = report
    assert_ratios_follow_from_the_rates(result, "mixtral", "p2r_moe_real", "p2r_moe_pseudo")
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
