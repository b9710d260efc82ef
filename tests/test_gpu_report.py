"""`make gpu-report`'s dry run (benchmarks/gpu_report.py --dry-run): every part of the GPU report runs at tiny size on
CPU and writes what the GPU run writes, so the command cannot rot between the rare runs on a GPU."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_report

from .training.helpers import REPO, subprocess_env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_report")
    done = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        # The dry run bounds each part itself (PARTS' dry-run limits); this only guards against the runner hanging. At
        # a load of 10 on two cores it took 846 s of the 900 s this was before.
        timeout=sum(limit for _, limit in gpu_report.PARTS.values()) + 300,
    )
    return done, out


def test_every_part_of_the_dry_run_succeeds_and_writes_its_json(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True
    assert {name: part["status"] for name, part in report["parts"].items()} == dict.fromkeys(gpu_report.PARTS, "ok")
    for part in gpu_report.PARTS:
        assert (out / f"{part}.json").is_file()


def test_the_page_names_the_device_and_reports_no_target_as_met(dry_run):
    _, out = dry_run
    page = (out / "report.md").read_text()
    assert "dry run on CPU" in page and f"Device: **{gpu_report.device_name()}**" in page
    rows = [line for line in page.splitlines() if line.startswith(tuple(f"| {name} |" for name in gpu_report.TARGETS))]
    assert len(rows) == len(gpu_report.TARGETS)
    assert all(row.endswith("| — (dry run) |") for row in rows)  # a dry run settles no target


def test_the_parts_measure_what_the_gpu_run_measures(dry_run):
    _, out = dry_run
    throughput = json.loads((out / "throughput.json").read_text())["result"]
    for mode in ("eager", "compiled"):
        assert set(throughput[mode]["tokens_per_s_median"]) == {"llama", "p2r_real", "p2r_pseudo"}
        assert throughput[mode]["flops_per_token"] > 0 and "mfu" in throughput[mode]  # MFU: None without a GPU peak
        assert throughput[mode]["config"]["mode"] == mode
    loss = json.loads((out / "loss_memory.json").read_text())["result"]
    assert loss["rows"] and all("plain" in row and "chunked" in row for row in loss["rows"])
    offload = json.loads((out / "offload.json").read_text())["designs"]
    for design in offload.values():
        runs = design["result"]["throughput"]["runs"]
        assert {"no offload", "granular ratio 0.5", "granular ratio 1.0", "fsdp2 CPUOffloadPolicy"} <= set(runs)
    trainer = json.loads((out / "trainer.json").read_text())
    assert "--mixed_precision bf16" in trainer["command"] and "--offload auto" in trainer["command"]
    assert [(d["num_blocks_before"], d["num_blocks"]) for d in trainer["result"]["delinks"]] == [(1, 4)]
    assert trainer["result"]["last"]["stage"] == "real"
    fsdp2 = json.loads((out / "fsdp2_dcp.json").read_text())
    assert "configs/accelerate/fsdp2.yaml" in fsdp2["command"] and "--checkpoint_format dcp" in fsdp2["command"]
    assert fsdp2["result"]["resume_steps_compared"]  # on the CPU a resume is exact and the export is the model
    assert fsdp2["result"]["resume_max_abs_loss_difference"] == 0.0
    assert fsdp2["result"]["export_max_abs_logit_difference"] == 0.0
    assert "Issue 25, FSDP2" in (out / "report.md").read_text()


def test_the_offload_parts_time_each_report_design_and_profile_where_the_step_goes(dry_run):
    """The offload part has a row per design of benchmarks/offload.py's REPORT_DESIGNS at each ratio; the profile part
    writes its table (on CPU: no CUDA activity, the host's phases by thread) and a small trace of every design."""
    from benchmarks import offload as bench
    from benchmarks import offload_profile

    _, out = dry_run
    runs = json.loads((out / "offload.json").read_text())["designs"]["report"]["result"]["throughput"]["runs"]
    for design in bench.REPORT_DESIGNS:
        assert {bench.granular_name(r, design) for r in (0.5, 1.0)} <= set(runs), design
    profile = json.loads((out / "offload_profile.json").read_text())
    assert profile["status"] == "ok" and set(profile["result"]["designs"]) == set(offload_profile.PROFILE_DESIGNS)
    for summary in profile["result"]["designs"].values():
        assert summary["gpu_ms"] is None and summary["step_ms"] > 0
        assert any(name.startswith("offload.fetch (launching thread)") for name in summary["host_ms"])
    assert any("offload.host_step (worker)" in s["host_ms"] for s in profile["result"]["designs"].values())
    page = (out / "offload_profile.md").read_text()
    assert page.startswith("# Granular offload: where the step goes (ratio 0.5)") and "| host offload.fetch" in page
    trace = json.loads((out / "offload_profile_trace.json").read_text())
    assert set(trace["designs"]) == set(offload_profile.PROFILE_DESIGNS)
    assert (out / "offload_profile_trace.json").stat().st_size < 2_000_000


def test_the_convergence_part_trains_both_runs_on_the_same_tokens_and_compares_their_flops(dry_run):
    """benchmarks/gpu_convergence.py's part in the dry run (issue 39): scratch and the recommended recipe, each for
    `DRY_STEPS` of a tiny model through the trainer's command line, on the same tokens."""
    from benchmarks import gpu_convergence

    _, out = dry_run
    record = json.loads((out / "convergence.json").read_text())
    assert record["status"] == "ok", record["output_tail"]
    result = record["result"]
    scratch, grown = result["runs"]
    assert [row["name"] for row in result["runs"]] == ["scratch", result["recipe"]]
    assert scratch["steps"] == grown["steps"] == gpu_convergence.DRY_STEPS
    assert scratch["tokens"] == grown["tokens"]  # the same tokens
    assert 0 < grown["flops"] < scratch["flops"]  # its shallow steps cost less
    assert result["target"] == scratch["final_val_loss"] and result["parameters"] > 0
    assert len(grown["flops_curve"]) >= 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_the_gpu_run_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "--dry-run" in done.stderr
    assert not any(tmp_path.iterdir())


def test_an_unknown_part_is_refused_naming_the_option(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", "--dry-run", "--parts", "tests,nope", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.startswith("gpu_report: --parts: unknown nope")


def test_a_budget_skips_the_parts_it_cannot_fit_and_says_so(tmp_path):
    """--budget (a GPU lent for a few minutes): with 10 s no part has its 30 s, each is recorded as skipped, the page
    still written."""
    done = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", "--dry-run", "--budget", "10", "--out", str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {name: part["status"] for name, part in report["parts"].items()} == dict.fromkeys(
        gpu_report.PARTS, "skipped"
    )
    assert "| tests | skipped |" in (tmp_path / "report.md").read_text()


def _run_report(path, date, parts, dry_run=False):
    machine = {"cpu_count": 16, "cpu": "Xeon", "torch": "2.11.0+cu130", "platform": "Linux"}
    report = {"date": date, "machine": machine, "dry_run": dry_run, "device": "NVIDIA H200", "seconds": 100.0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "parts": parts}))
    return path


def test_a_page_of_several_runs_takes_each_part_from_the_latest_run_that_ran_it(tmp_path, capsys):
    """`--page` (a GPU lent twice for minutes): a later run's part replaces an earlier one's, a skipped part replaces
    nothing, each part keeps its run's date; the growth comparison is read from convergence.json in OUT."""
    ok = {"status": "ok", "seconds": 10.0}
    first = _run_report(
        tmp_path / "1" / "report.json",
        "2026-11-26T10:00:00+00:00",
        {"tests": {**ok, "command": "old tests"}, "offload": {**ok, "command": "old offload"}},
    )
    second = _run_report(
        tmp_path / "2" / "report.json",
        "2026-11-28T10:00:00+00:00",
        {"tests": {**ok, "command": "new tests"}, "offload": {"status": "skipped", "seconds": 0.0, "command": "-"}},
    )
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "tests.json").write_text(json.dumps({**ok, "command": "new tests"}))
    (out / "offload.json").write_text(json.dumps({**ok, "command": "old offload"}))
    scratch = {"name": "scratch", "final_val_loss": 1.5, "flops": 2e15, "tokens": 4096}
    grown = {"name": "bu-1to8-at80", "final_val_loss": 1.6, "flops": 6e14, "budget_ratio": 0.3, "flops_to_target": None}
    (out / "convergence.json").write_text(
        json.dumps({"result": {"parameters": 1.2e8, "steps": 8, "runs": [scratch, grown]}})
    )

    assert gpu_report.main(["--page", str(first), str(second), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert {name: (part["command"], part["date"][:10]) for name, part in report["parts"].items()} == {
        "tests": ("new tests", "2026-11-28"),
        "offload": ("old offload", "2026-11-26"),
    }
    page = (out / "report.md").read_text()
    assert "| tests | ok | 10 | `new tests` | 2026-11-28T10:00:00+00:00 |" in page
    assert "from 2 runs of `python scripts/gpu_report.py`" in page
    assert "`bu-1to8-at80` spent 0.30 of those FLOPs, its final loss 1.6000: it ended +0.1000 above" in page
    capsys.readouterr()


def test_a_page_refuses_a_dry_run_or_a_file_that_is_not_a_report_in_one_line(tmp_path, capsys):
    dry = _run_report(tmp_path / "dry" / "report.json", "2026-11-28T10:00:00+00:00", {}, dry_run=True)
    (tmp_path / "other.json").write_text("[1, 2]")
    for path in (dry, tmp_path / "other.json", tmp_path / "missing.json"):
        assert gpu_report.main(["--page", str(path), "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert error == f"gpu_report: --page: {path}: not the report.json of a GPU run\n"
    assert not (tmp_path / "out").exists()


def test_a_page_refuses_a_part_record_of_another_run_in_one_line(tmp_path, capsys):
    """The targets are read from OUT's part records: one left from an older run than the page names is refused."""
    ok = {"status": "ok", "seconds": 10.0}
    run = _run_report(tmp_path / "1" / "report.json", "2026-11-28T10:00:00+00:00", {"tests": {**ok, "command": "new"}})
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "tests.json").write_text(json.dumps({**ok, "command": "old"}))
    assert gpu_report.main(["--page", str(run), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"gpu_report: --page: {out / 'tests.json'} is not the record")
    assert not (out / "report.md").exists()
