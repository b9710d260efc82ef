"""benchmarks/scale.py end to end in its smoke mode (`--quick`: the trainer on 1 and 2 processes, a tiny and a
14M-parameter model, the 2-process sharded checkpoint resumed on 1 process): every figure on the page follows from the
per-process measurements, and the committed page is the render of the committed JSON.

No memory figure or timing is asserted against a target (a shared CPU); the resumed losses are, within the page's
tolerance: that is what the benchmark checks.
"""

import json

import pytest

from benchmarks import scale as bench
from benchmarks.harness import REPO

from .bench_report import bench_report

# Its benchmark runs each measurement in a fresh process (the shared report fixture hides that from the marking).
pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    return bench_report(bench, tmp_path_factory, "scale", ["--quick"])


@pytest.mark.slow
def test_each_row_is_its_processes_measurements(report):
    result, _ = report
    rows = {(r["model"], r["layout"]): r for r in result["rows"]}
    assert set(rows) == {(m, la) for m in ("tiny", "w512-L4") for la in ("1 process", "2 sharded (FSDP2)")}
    for row in rows.values():
        assert len(row["peak_bytes_per_process"]) == row["processes"]
        assert row["peak_bytes_max"] == max(row["peak_bytes_per_process"])
        assert row["peak_bytes_total"] == sum(row["peak_bytes_per_process"])
        assert row["peak_bytes_max"] == max(row["phase_peak_bytes_of_the_highest_process"].values())
        assert {"build", "steps", "delink", "save checkpoint", "save pseudo/, real/"} <= set(
            row["phase_peak_bytes_of_the_highest_process"]
        )
        assert row["startup_s"] > 0 and row["save_s"] > 0
    for layout in ("1 process", "2 sharded (FSDP2)"):
        row, tiny = rows["w512-L4", layout], rows["tiny", layout]
        params, n = row["parameters"], row["processes"]
        assert row["above_tiny_bytes"] == row["peak_bytes_max"] - tiny["peak_bytes_max"]
        assert row["bound_bytes"] == 16 * params / n + 2 * params
        assert row["within_bound"] == (row["above_tiny_bytes"] <= row["bound_bytes"])
        assert row["planner_margin"] == (row["above_tiny_bytes"] - row["planner_bytes"]) / row["planner_bytes"]
    assert rows["w512-L4", "1 process"]["save_vs_one_process"] == 1.0


@pytest.mark.slow
def test_the_sharded_checkpoint_resumes_on_one_process_within_the_tolerance(report):
    result, _ = report
    (resume,) = result["resumes"]
    assert (resume["layout"], resume["processes"]) == ("1 process", 1)
    assert sorted(resume["losses"]) == sorted(resume["uninterrupted_losses"]) == ["4", "5"]  # steps after checkpoint-3
    assert resume["load_s"] > 0 and resume["within_tolerance"]


@pytest.mark.slow
def test_markdown_is_rendered_from_the_json(report):
    result, markdown = report
    assert markdown == bench.render(result)
    assert "python scripts/bench_scale.py --quick" in markdown
    rows = [r for r in result["rows"] if r["model"] == "w512-L4"]
    start = f"| w512-L4 | {rows[0]['parameters'] / 1e6:.1f}M |"
    table = [line for line in markdown.splitlines() if line.startswith(start)]
    assert len(table) == len(rows) == 2
    after = markdown.split("## Where the highest process peaks")[1]
    phases = [line for line in after.splitlines() if "w512-L4" in line]
    assert len(phases) == 2  # the largest model's rows


def test_committed_markdown_is_the_render_of_the_committed_json():
    benchmarks = REPO / "benchmarks"
    result = json.loads((benchmarks / "scale.json").read_text())
    assert (benchmarks / "scale.md").read_text() == bench.render(result)
    assert "--quick" not in result["command"]
