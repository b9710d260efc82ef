"""benchmarks/throughput.py end to end on its tiny preset: the report is consistent with what it measured.

No timing is asserted: only that every reported ratio, median and byte count follows from the measured numbers.
"""

import json
import statistics

import pytest

from benchmarks import throughput as bench
from benchmarks.harness import REPO

from .bench_report import TINY_THROUGHPUT, assert_ratios_follow_from_the_rates, report_fixture

report = report_fixture(bench, "throughput", TINY_THROUGHPUT)


def test_ratios_and_medians_follow_from_the_measured_rates(report):
    result, _ = report
    assert_ratios_follow_from_the_rates(result, "llama", "p2r_real", "p2r_pseudo")
    rates = result["tokens_per_s"]
    assert all(len(values) == 2 and all(v > 0 for v in values) for values in rates.values())
    for name, values in rates.items():
        assert result["tokens_per_s_median"][name] == statistics.median(values)


def test_training_state_bytes_add_up_and_match_the_expected_ratio(report):
    result, _ = report
    state = result["training_state_bytes"]
    for parts in state.values():
        assert parts["total"] == parts["parameters"] + parts["gradients"] + parts["optimizer"]
        assert parts["gradients"] == parts["parameters"]  # fp32 gradients kept allocated
    assert state["llama"] == state["p2r_real"], "same dimensions, same tensors"
    ratio = result["state_ratio_pseudo_vs_real"]
    assert ratio["measured"] == state["p2r_pseudo"]["total"] / state["p2r_real"]["total"]
    # (embeddings + head + k blocks) / (embeddings + head + L blocks); AdamW's step counters are the only difference.
    assert ratio["measured"] == pytest.approx(ratio["expected"], rel=1e-3)
    assert result["config"]["num_hidden_layers"] == 4 and result["config"]["pseudo_num_unique_layers"] == 2


def test_markdown_is_rendered_from_the_json(report):
    result, markdown = report
    assert markdown == bench.render_markdown(result)
    assert f"| P2R pseudo / P2R real | {result['ratio_pseudo_vs_real']['median']:.3f} |" in markdown
    assert f"measured {result['state_ratio_pseudo_vs_real']['measured']:.4f}" in markdown
    assert "--device cpu --preset tiny" in markdown
    assert "pending a run on a GPU" in markdown


def test_committed_markdown_is_the_render_of_the_committed_json():
    benchmarks = REPO / "benchmarks"
    result = json.loads((benchmarks / "throughput.json").read_text())
    assert (benchmarks / "throughput.md").read_text() == bench.render_markdown(result)
