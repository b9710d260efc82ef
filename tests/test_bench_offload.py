"""benchmarks/offload.py's search for the largest trainable model, on CPU with fake probes (the benchmark itself
needs CUDA). On the first GPU run `--part largest` was OOM-killed: its first guesses at ratio 0.5 were all out of
device memory and the search never went below them, and the host guard under-counted pinned memory."""

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
    """`--offload-optimizer both` adds a "... device_chunked" row per ratio; each row trains with its design and the
    offload's own clip, as the trainer does."""
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
    assert "Targets (host step): ratio 0.5 ≥ 0.85 of no offload: **0.800**" in page
    assert "Targets (device_chunked step): ratio 0.5 ≥ 0.85 of no offload: **0.600**" in page
    assert "device_chunked (1 MiB chunks) vs host step, tokens/s by ratio: 0.0: 0.750x, 0.25: 0.750x" in page
