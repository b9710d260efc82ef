"""benchmarks/pipeline_sim.py: its simulator-at-scale rows and its report, without the (minutes-long) CPU runs."""

import re

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks import pipeline_sim

    return pipeline_sim


def test_2bw_beats_the_flush_schedules_by_their_bubble(bench):
    """At m = d every schedule fits the 2.7B model on 8 GPUs; GPipe and 1F1B run about the same time (the same flush
    bubble: equal for equal stages, within 1% on the trainer's balanced split, whose last stage is lighter), and
    2BW's steady state has none, so it is faster by at least the busiest stage's flush bubble."""
    rows = bench.at_scale("gpt-2.7B", 8, 8)
    assert all(row["fits"] and not row["recompute"] for row in rows.values())
    assert rows["gpipe"]["step_s"] == pytest.approx(rows["1f1b"]["step_s"], rel=1e-2)
    assert rows["2bw"]["bubble"] == pytest.approx(0, abs=1e-9)
    gain = rows["2bw"]["sequences_per_s"] / rows["1f1b"]["sequences_per_s"]
    assert gain == pytest.approx(1 / (1 - rows["1f1b"]["bubble"]), rel=1e-9)
    assert rows["2bw"]["gpu_gib"] > rows["1f1b"]["gpu_gib"]  # the second weight version


def test_report_names_what_the_notes_lack(bench):
    stage = {"together": (0.01, 0.02), "alone": (0.01, 0.02)}
    rounds = [
        {"stages": [stage, stage], "p2p_s": 0.001, "measured_step_s": {"gpipe": 0.2, "1f1b": 0.19, "2bw": step}}
        for step in (0.15, 0.13, 0.14)
    ]
    run = {"processes": 2, "microbatches": 4, "threads_per_process": 1, "rounds": rounds}
    run["two_bw_update_s"] = [0.002, 0.002]
    run["predicted"] = bench.predict(run)
    assert set(run["predicted"]) == {"gpipe", "1f1b", "2bw"}
    result = {
        "date": "2026-01-01T00:00:00+00:00",
        "command": "python scripts/bench_pipeline_sim.py",
        "machine": {"cpu": "cpu", "cpu_count": 2, "torch": "2", "platform": "linux"},
        "preset": {"name": "tiny", **bench.PRESETS["tiny"]},
        "measured": [run],
        "load_average_1min": {"start": 1.0, "end": 2.0},
        "hardware": vars(__import__("hf_p2r.planning", fromlist=["Hardware"]).Hardware()),
        "at_scale": {"gpt-2.7B": {"8": {"8": bench.at_scale("gpt-2.7B", 8, 8)}}},
        "sweep": {"model": "gpt-2.7B", "microbatches": "2 d", "rows": {"4": bench.sweep("gpt-2.7B", 4, 8)}},
    }
    text = bench.render_markdown(result)
    # Two equal stages, m = 4, send 1 ms: (m + d - 1)(f + b) + 2 sends = 5 x 30 ms + 2 ms.
    assert run["predicted"]["gpipe"]["predicted_together_s"] == [pytest.approx(0.152)] * 3
    assert "| gpipe | 0.200 (0.200 - 0.200) | 0.152 | 0.76 (0.76 - 0.76) |" in text
    # 2BW in steady state: per micro-batch f + b and the send round trip 2 (d - 1) l / d = 1 ms, plus the update:
    # 4 x 31 ms + 2 ms, against the median interval 0.14 s.
    assert run["predicted"]["2bw"]["predicted_together_s"] == [pytest.approx(0.126)] * 3
    assert "| 2bw | 0.140 (0.130 - 0.150) | 0.126 | 0.90 (0.84 - 0.97) |" in text
    assert "not in our notes" in text and "up to 3.2x" in text
    rows = result["sweep"]["rows"]["4"]
    assert [rows[s]["peak_in_flight"] for s in ("gpipe", "1f1b", "2bw")] == [8, 4, 4]  # m, d, d
    assert [rows[s]["peak_versions"] for s in ("gpipe", "1f1b", "2bw")] == [1, 1, 2]
    assert re.search(r"^\| 4 \| 8 \| 2bw \| [0-9.]+ \| [0-9.]+ \| 0% \| 4 \| 2 \|", text, flags=re.MULTILINE)
