"""benchmarks/loss_memory.py end to end in its smoke mode: the page is rendered from what was measured.

No memory figure or timing is asserted (tiny sizes on a shared CPU): only that every ratio follows from the measured
numbers, both paths computed the same loss, and the committed page is the render of the committed JSON.
"""

import json
import statistics

import pytest

from benchmarks import loss_memory as bench
from benchmarks.harness import REPO

from .bench_report import bench_report

# Its benchmark runs each measurement in a fresh process (the shared report fixture hides that from the marking).
pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    return bench_report(bench, tmp_path_factory, "loss_memory", ["--smoke"])


def test_every_size_has_both_paths_and_the_ratios_follow_from_them(report):
    result, _ = report
    smoke = bench.PRESETS["smoke"]
    assert [(r["vocab"], r["tokens"]) for r in result["rows"]] == smoke["sizes"]
    for row in result["rows"]:
        plain, chunked = row["plain"], row["chunked"]
        assert plain["peak_bytes"] > 0 and chunked["peak_bytes"] > 0
        assert row["memory_ratio_plain_vs_chunked"] == plain["peak_bytes"] / chunked["peak_bytes"]
        assert len(plain["seconds"]) == len(chunked["seconds"]) == smoke["repeats"]
        assert row["time_ratio_chunked_vs_plain"] == pytest.approx(
            statistics.median(chunked["seconds"]) / statistics.median(plain["seconds"])
        )
        assert row["logits_fp32_bytes"] == row["tokens"] * row["vocab"] * 4
        assert row["loss_relative_difference"] <= 1e-5  # same inputs, same loss, in two processes
        assert all(len(r["load_average"]) == 2 for r in (plain, chunked))


def test_markdown_is_rendered_from_the_json(report):
    result, markdown = report
    assert markdown == bench.render_markdown(result)
    assert "Produced by `scripts/bench_loss_memory.py --smoke`" in markdown
    assert "Load average (1 min) around the runs" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(result["rows"])
    first = result["rows"][0]
    assert f"| {first['memory_ratio_plain_vs_chunked']:.2f} | {first['time_ratio_chunked_vs_plain']:.2f} |" in table[0]
    assert "pending a run on a GPU" in markdown


def test_committed_markdown_is_the_render_of_the_committed_json():
    benchmarks = REPO / "benchmarks"
    result = json.loads((benchmarks / "loss_memory.json").read_text())
    assert (benchmarks / "loss_memory.md").read_text() == bench.render_markdown(result)
    assert not result["config"]["smoke"] and result["config"]["device"] == "cpu"
