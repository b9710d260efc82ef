"""benchmarks/offload.py's search for the largest trainable model, on CPU with fake probes (the benchmark itself
needs CUDA). On the first GPU run `--part largest` was OOM-killed: its first guesses at ratio 0.5 were all out of
device memory and the search never went below them, and the host guard under-counted pinned memory."""

import json

import pytest

from benchmarks import offload as bench

GIB = 2**30


def device_limit(limit: int, probed: list[int]):
    def probe(layers: int) -> bool:
        probed.append(layers)
        return layers <= limit

    return probe


def test_an_out_of_memory_first_guess_searches_downwards_to_the_exact_limit():
    """The GPU run's ratio 0.5: 325 layers predicted, out of device memory; it stopped after 325, 298, 274."""
    probed = []
    found = bench.search_largest(device_limit(250, probed), 325, lambda n: True, max_probes=12)
    assert (found["largest_ok"], found["smallest_failed"], found["host_bound"]) == (250, 251, False)
    assert probed[:2] == [325, 244]  # down by a quarter, then up and bisecting
    assert found["probes"] == [(n, n <= 250) for n in probed]  # every probe, in order


@pytest.mark.parametrize("limit", [1, 7, 40, 100, 101, 187, 1000])
@pytest.mark.parametrize("first", [1, 50, 100, 300])
def test_the_search_brackets_the_limit_from_any_first_guess(limit, first):
    probed = []
    found = bench.search_largest(device_limit(limit, probed), first, lambda n: True, max_probes=40)
    assert (found["largest_ok"], found["smallest_failed"]) == (limit, limit + 1)
    assert len(probed) == len(set(probed))  # no count probed twice


def test_nothing_fits():
    found = bench.search_largest(device_limit(0, []), 10, lambda n: True, max_probes=40)
    assert (found["largest_ok"], found["smallest_failed"]) == (None, 1)


def test_a_count_the_host_cannot_hold_is_never_probed():
    probed = []
    found = bench.search_largest(device_limit(300, probed), 100, lambda n: n <= 104, max_probes=40)
    assert max(probed) == 104 and found["largest_ok"] == 104
    assert (found["smallest_failed"], found["host_bound"]) == (None, True)


def test_the_number_of_probes_is_bounded():
    probed = []
    found = bench.search_largest(device_limit(250, probed), 4000, lambda n: True, max_probes=5)
    assert len(probed) == len(found["probes"]) == 5


MEMINFO = """MemTotal:       131072000 kB
MemFree:         1000000 kB
MemAvailable:   125829120 kB
Shmem:           2097152 kB
Mlocked:               0 kB
HugePages_Total:       0
"""


def test_meminfo_in_bytes_and_the_margin():
    info = bench.meminfo(MEMINFO)
    assert info["MemAvailable"] == 125829120 * 1024 and info["Shmem"] == 2 * GIB and info["HugePages_Total"] == 0
    # 10% of 125 GiB of MemTotal is kept free (more than the 4 GiB floor).
    assert bench.host_budget_bytes(info) == 120 * GIB - int(0.1 * 125 * GIB)
    small = bench.meminfo(MEMINFO.replace("131072000", "8388608").replace("125829120", "6291456"))
    assert bench.host_budget_bytes(small) == 2 * GIB  # 6 GiB available, the 4 GiB floor kept


def test_pinned_slabs_are_charged_at_the_measured_cost():
    dims = bench.PRESETS["cuda"]["dims"]
    once, twice = (bench.host_need_bytes(dims, 40, 1.0, None, factor) for factor in (1.0, 2.0))
    model = bench.shapes(dims, 40)
    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    pinned = once - 3 * block * 40  # gradients and two AdamW moments are pageable
    assert pinned >= block * 40 and twice - once == pinned  # each slab holds its fp32 masters at least


def test_the_largest_search_is_never_oom_killed_when_the_kernel_counts_more_than_estimated(monkeypatch):
    """A fake machine: 128 GiB, whose kernel charges each probe 1.15 times the estimate (pinned memory counted at the
    measured factor, and more it does not know of); a probe using more than what is available would be killed.
    Device memory holds up to 300 layers, the first guess is 400."""
    total, available = 128 * GIB, 120 * GIB
    dims = bench.PRESETS["cuda"]["dims"]
    host = {"pinned_factor": 2.0, "scale": 1.0, "measured": False}
    used, calls = [], []

    def fake_try_training(dims_, layers, ratio, batch, device):
        use = int(1.15 * bench.host_need_bytes(dims, layers, ratio, None, host["pinned_factor"]))
        assert use <= available, f"{layers} layers: {use / GIB:.1f} GiB, the kernel would kill the process"
        used.append(use)
        calls.append(layers)
        return {"fits": layers <= 300, "host_used": use}

    monkeypatch.setattr(bench, "try_training", fake_try_training)
    monkeypatch.setattr(bench, "meminfo", lambda: {"MemTotal": total, "MemAvailable": available})
    preset = {**bench.PRESETS["cuda"], "max_trials": 12}
    row = bench._largest_at(1.0, 400, dims, None, "cpu", host, preset)
    assert row["largest_ok_layers"] is not None and row["host_bound"]
    assert row["largest_ok_layers"] < 300  # the host, not the device, is the limit at full offload
    assert max(used) <= available - int(0.1 * total)  # the margin held too
    assert [t["layers"] for t in row["trials"]] == calls  # every probe recorded, with its host memory
    assert all(t["host_used_GiB"] > 0 and t["host_estimated_GiB"] > 0 for t in row["trials"])
    assert host["scale"] == pytest.approx(1.15, rel=1e-3)  # learnt from the first probe that trained


@pytest.mark.parametrize(
    ("name", "design", "overlapped"),
    [("granular ratio 0.5", "host", True), ("granular ratio 0.5 device_chunked", "device_chunked", False)],
)
def test_each_offload_design_is_a_throughput_row(name, design, overlapped):
    """`--designs host,device_chunked` adds a "... device_chunked" row per ratio; each row trains with its design and
    the offload's own clip, as the trainer does."""
    import torch

    dims = bench.PRESETS["cpu"]["dims"]
    assert bench.granular_name(0.5, design) == name
    model, optimizer, offload = bench.setup(name, dims, "cpu", chunk_bytes=4096)
    assert (offload.optimizer_step, offload.overlap_step, offload.chunk_bytes) == (design, overlapped, 4096)
    assert offload.layers == [1, 3]
    batch = torch.randint(0, dims["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in offload.offloaded_parameters]
    bench.train_step(model, optimizer, batch, 2, "cpu", offload)
    offload.synchronize()
    assert all(not torch.equal(p, q) for p, q in zip(offload.offloaded_parameters, before))  # stepped
    offload.remove()


def test_the_results_page_compares_the_designs():
    runs = {"no offload": 100.0, "fsdp2 CPUOffloadPolicy": 10.0}
    for design, speed in (("host", 80.0), ("device_chunked", 60.0)):
        runs.update({bench.granular_name(r, design): speed for r in bench.RATIOS})
    result = {
        "machine": {"cpu": "test CPU", "cpu_count": 2, "torch": "2.x", "platform": "test"},
        "model": bench.PRESETS["cpu"]["dims"],
        "command": "scripts/bench_offload.py --device cpu --offload-optimizer both",
        "date": "today",
        "load_average_before": (1.0, 2.0, 3.0),
        "load_average_after": (1.5, 2.0, 3.0),
        "bandwidth": {"host_to_device_GBps": 1.0, "device_to_host_GBps": 1.0},
        "throughput": {
            "batch": 2,
            "seq": 32,
            "accumulation": 2,
            "steps": 2,
            "designs": ["host", "device_chunked"],
            "chunk_bytes": 2**20,
            "runs": {
                name: {"tokens_per_s": speed, "vs_no_offload": speed / 100.0, "peak_device_GiB": None}
                for name, speed in runs.items()
            },
        },
    }
    page = bench.render_markdown(result, smoke=False)
    assert "CPU run (compute device = CPU" in page and "before: 1.00, 2.00, 3.00; after: 1.50, 2.00, 3.00" in page
    assert (
        "No GPU target is judged on a CPU run. Noise floor: ratio 0.0 (hooks only, nothing offloaded) ran at 0.800"
        in (page)
    )
    assert "Targets" not in page
    page = bench.render_markdown({**result, "machine": {**result["machine"], "gpu": "a GPU"}}, smoke=False)
    assert "CPU run" not in page
    assert (
        "Targets (host): ratio 0.5 ≥ 0.85 of no offload: **0.800**; ratio 1.0 ≥ 0.6 of no offload: **0.800**; full "
        "offload ≥ 3x FSDP2 CPUOffloadPolicy: **80 vs 10 tokens/s (8.00x)**." in page
    )
    assert "Targets (device_chunked): ratio 0.5 ≥ 0.85 of no offload: **0.600**" in page
    assert "device_chunked (1 MiB chunks) vs host step, tokens/s by ratio: 0.0: 0.750x, 0.25: 0.750x" in page


# ------------------------------------------------------------------------------------------- designs (issue 40)


@pytest.mark.parametrize("design", list(bench.DESIGNS))
def test_every_design_trains_a_row_with_its_options(design):
    """Each design's row builds GranularOffload with its options and tells it the step's last micro-batch; its
    offloaded blocks are stepped (clipped unless the design steps them during the backward)."""
    import torch

    dims = bench.PRESETS["cpu"]["dims"]
    model, optimizer, offload = bench.setup(bench.granular_name(0.5, design), dims, "cpu", chunk_bytes=4096)
    for key, value in bench.DESIGNS[design].items():
        assert getattr(offload, key) == value, key
    assert isinstance(offload.last_micro_batch, bench.LastMicroBatch)
    batch = torch.randint(0, dims["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in offload.offloaded_parameters]
    for _ in range(2):
        bench.train_step(model, optimizer, batch, 2, "cpu", offload, clip=bench.clips(design))
    offload.synchronize()
    assert all(not torch.equal(p, q) for p, q in zip(offload.offloaded_parameters, before))
    offload.remove()


def test_the_report_designs_and_the_options_are_checked():
    assert set(bench.REPORT_DESIGNS) <= set(bench.DESIGNS) and bench.clips("host")
    assert bench.parse_designs("report", None) == bench.REPORT_DESIGNS
    assert bench.parse_designs(None, "both") == ("host", "device_chunked")
    assert bench.parse_designs("host,nope", None).startswith("--designs: unknown nope (known: host, ")
    assert bench.parse_ratios("0.5,1") == (0.5, 1.0) and bench.parse_ratios("2").startswith("--ratios: expected")


def _gpu_result(date: str, gpu: str = "NVIDIA H200") -> dict:
    runs = {"no offload": 100.0, "fsdp2 CPUOffloadPolicy": 10.0, "granular ratio 0.5": 50.0, "granular ratio 1.0": 29.0}
    return {
        "date": date,
        "machine": {"cpu": "x", "cpu_count": 16, "torch": "2.x", "platform": "p", "gpu": gpu},
        "model": bench.PRESETS["cuda"]["dims"],
        "command": "scripts/bench_offload.py --part throughput --device cuda",
        "bandwidth": {"host_to_device_GBps": 55.0, "device_to_host_GBps": 55.0},
        "throughput": {
            "batch": 4,
            "seq": 2048,
            "accumulation": 8,
            "steps": 4,
            "designs": ["host"],
            "runs": {
                name: {"tokens_per_s": v, "vs_no_offload": v / 100, "peak_device_GiB": 1.0} for name, v in runs.items()
            },
        },
    }


def test_the_page_shows_the_latest_gpu_result_with_its_date_and_device(tmp_path, monkeypatch):
    """`--page` writes benchmarks/offload.md from the newest GPU result on file: a gpu-report part record (designs) or
    the script's own CUDA run; never 'pending' when one exists."""
    import json

    monkeypatch.setattr(bench, "REPO", tmp_path)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "offload.json").write_text(
        json.dumps({"status": "ok", "designs": {"both": {"status": "ok", "result": _gpu_result("2026-11-26T16:57")}}})
    )
    paths = (bench.Path("offload.json"), bench.Path("gpu/offload.json"))
    page = bench.write_page(paths, bench.Path("offload.md")).read_text()
    assert "Latest GPU measurement: **NVIDIA H200**, 2026-11-26T16:57, from `gpu/offload.json`" in page
    assert "| granular ratio 0.5 | 50 | 0.500 |" in page and "pending" not in page
    assert "full offload ≥ 3x FSDP2 CPUOffloadPolicy: **29 vs 10 tokens/s (2.90x)**" in page
    (tmp_path / "offload.json").write_text(json.dumps(_gpu_result("2026-12-01T10:00", gpu="NVIDIA H100")))
    page = bench.write_page(paths, bench.Path("offload.md")).read_text()
    assert "Latest GPU measurement: **NVIDIA H100**, 2026-12-01T10:00, from `offload.json`" in page
    monkeypatch.setattr(bench, "REPO", tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    assert "No GPU result is on file yet" in bench.write_page(paths, bench.Path("offload.md")).read_text()


def test_the_committed_page_is_the_scripts_output():
    """benchmarks/offload.md is what `--page` writes from the results on file (regenerate it after a GPU run)."""
    from benchmarks.harness import REPO

    committed = (REPO / "benchmarks" / "offload.md").read_text()
    assert "pending" not in committed
    newest = bench.gpu_results()[0][1]
    assert f"Latest GPU measurement: **{newest['machine']['gpu']}**, {newest['date']}" in committed


# ------------------------------------------------------------------------------------------------ the profile


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_the_profile_table_splits_the_step_into_busy_copies_idle_and_waits():
    """A step of 100 µs on the launching thread: kernels 0-40 and 30-50 (busy 50), a copy to the device 45-70 (20 of
    it outside kernels), idle 70-100, 10 µs of which in `offload.wait_step`; the worker's host step 20-80."""
    from benchmarks import offload_profile

    trace = {
        "traceEvents": [
            _event(offload_profile.STEP, "user_annotation", 0, 100),
            _event("k1", "kernel", 0, 40, tid=7),
            _event("k2", "kernel", 30, 20, tid=7),
            _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 45, 25, tid=8),
            _event("offload.wait_step", "user_annotation", 80, 10),
            _event("offload.host_step", "user_annotation", 20, 60, tid=2),
            _event("k3", "kernel", 200, 10, tid=7),  # outside every step: not counted
        ]
    }
    summary = offload_profile.summarize(trace)
    gpu = summary["gpu_ms"]
    assert summary["steps"] == 1 and summary["step_ms"] == pytest.approx(0.1)
    assert gpu["busy (kernels)"] == pytest.approx(0.05) and gpu["copies HtoD"] == pytest.approx(0.025)
    assert gpu["copies no kernel hides"] == pytest.approx(0.02) and gpu["idle"] == pytest.approx(0.03)
    assert gpu["idle in offload.wait_step"] == pytest.approx(0.01)
    assert summary["host_ms"] == {
        "offload.host_step (worker)": pytest.approx(0.06),
        "offload.wait_step (launching thread)": pytest.approx(0.01),
    }
    small = offload_profile.small_trace(trace)["traceEvents"]
    assert [e["name"] for e in small].count("gpu busy") == 2 and not any(e["name"].startswith("k") for e in small)
    with pytest.raises(ValueError, match="has no 'offload.profile.step' range"):
        offload_profile.summarize({"traceEvents": []})


def test_the_profile_part_runs_on_cpu_and_writes_its_table_and_small_trace(tmp_path):
    """`--part profile --device cpu --smoke` (the dry run's): each design profiled at ratio 0.5; on CPU no CUDA
    activity, offload's host ranges by thread."""
    import json

    from benchmarks import offload_profile

    out = tmp_path / "offload_profile"
    assert bench.main(["--part", "profile", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["designs"]) == set(offload_profile.PROFILE_DESIGNS) and result["ratio"] == 0.5
    for design, summary in result["designs"].items():
        assert summary["gpu_ms"] is None and summary["steps"] == 1, design
        assert summary["host_ms"]["offload.fetch (launching thread)"] > 0
        assert summary["host_ms"]["offload.host_step (worker)"] > 0
    assert "offload.host_accumulate (worker)" in result["designs"]["host"]["host_ms"]
    assert "offload.accumulate_on_device (launching thread)" in result["designs"]["device_sums"]["host_ms"]
    page = out.with_suffix(".md").read_text()
    assert "| GPU | no CUDA activity (a CPU run) |" in page
    trace = json.loads((tmp_path / "offload_profile_trace.json").read_text())["designs"]["host"]["traceEvents"]
    assert trace and all(e["name"].startswith("offload.") for e in trace)


def test_the_host_phases_benchmark_measures_and_predicts(tmp_path):
    """benchmarks/offload_host.py --smoke: each update and host phase measured (GB/s), and the GPU run on file
    predicted by the step-time model for each design at ratios 0.25, 0.5 and 1.0, with this host's rates and with the
    fitted ones, beside the measured step times."""
    import json

    from benchmarks import offload_host

    out = tmp_path / "host"
    assert offload_host.main(["--smoke", "--blocks", "2", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert {"torch fused", "torch foreach", "torch for-loop"} <= set(result["update"])
    assert any("2 blocks on 2 thread(s)" in name for name in result["update"])
    assert all(row["GBps"] > 0 for row in [*result["update"].values(), *result["phases"].values()])
    run = offload_host.gpu_run()
    if run is not None:  # benchmarks/gpu/offload.json holds a GPU run of today's design
        predicted = result["predicted"]
        assert set(predicted["this_host"]) == set(predicted["fit"]["band"]) == set(offload_host.DESIGNS)
        assert all(set(row) == {"0.25", "0.5", "1.0"} for row in predicted["fitted_host"].values())
        page = out.with_suffix(".md").read_text()
        assert f"benchmarks/gpu/offload.json of {run['date']}" in page and "| today | **measured** |" in page
    assert "smoke run" in out.with_suffix(".md").read_text()


@pytest.fixture(scope="module")
def delayed(tmp_path_factory) -> tuple[dict, str]:
    """benchmarks/offload_delayed.py --smoke, run once for the module: (its JSON result, its page)."""
    from benchmarks import offload_delayed

    folder = tmp_path_factory.mktemp("offload_delayed")
    out = folder / "offload_delayed"
    assert offload_delayed.main(["--smoke", "--out", str(out), "--work", str(folder / "runs")]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def test_the_delayed_update_benchmark_runs_side_by_side(delayed):
    """benchmarks/offload_delayed.py --smoke: the trainer three times (exact, delayed, delayed + error feedback) from
    the same seed; the exact and delayed runs agree on the first step (nothing to be stale yet) and differ after."""
    from benchmarks import offload_delayed

    result, page = delayed
    runs = result["runs"]
    assert list(runs) == list(offload_delayed.RUNS)
    exact, stale = runs["after_backward"]["loss"], runs["delayed"]["loss"]
    assert exact["1"] == stale["1"] and exact != stale
    assert "Final validation loss against the exact update" in page


def test_offload_delayed_smoke_writes_its_page_from_its_runs(delayed):
    """benchmarks/offload_delayed.py --smoke (a few steps of a tiny model, each run the trainer in its own process):
    the exact, delayed and corrected runs all finish and the page is the render of the JSON it wrote (no figure
    asserted: a smoke run)."""
    from benchmarks import offload_delayed

    result, page = delayed
    assert result["smoke"] and set(result["runs"]) == set(offload_delayed.RUNS)
    assert page == offload_delayed.render_markdown(result)
