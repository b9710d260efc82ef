"""Where the offloaded step's milliseconds go: a `torch.profiler` trace of a few training steps at ratio 0.5 (CPU and
CUDA activity; granular offload's `record_function` ranges name its phases: `offload.fetch`, `offload.gradient_copy`,
`offload.accumulate_on_device`, `offload.host_accumulate`, `offload.host_step`, `offload.refresh_copies`, and its
waits, `offload.wait_*`), summarised per design into a table:

- GPU busy (the union of its kernels), copies (host<->device memcpy, and the part of them no kernel hides), GPU idle
  (neither), and the idle time during which the launching thread sat in one of offload's waits (by wait: the GPU
  waiting for the host);
- the host's compute by phase and thread (the launching thread; the offload worker), per step, wherever it ran (a
  step's updates overlap the next step's forward; the last step's are waited for after the last window).

    python scripts/bench_offload.py --part profile --device cuda --out benchmarks/gpu/offload_profile
    python scripts/bench_offload.py --part profile --device cpu --smoke    # the dry run: no CUDA activity

It writes `<out>.md` (the table), `<out>.json` (the same figures) and `<out>_trace.json`: a summarised Chrome trace
(open it in Perfetto or chrome://tracing) with the steps, offload's ranges and the GPU's busy intervals merged, small
enough to commit (the full trace has every kernel). `make gpu-report`'s `offload_profile` part runs it.
"""

import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.harness import load_averages, machine, publish, utc_now, write_json
from hf_p2r.compat import profiler_config_all_threads

STEP = "offload.profile.step"
PROFILE_DESIGNS = ("host", "device_sums", "device_sums_delayed")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersect(a, b) -> list[tuple[float, float]]:
    """The intersection of two unions of disjoint sorted intervals."""
    found, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            found.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return found


def _minus(a, b) -> list[tuple[float, float]]:
    """`a` less `b` (both unions of disjoint sorted intervals)."""
    found = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                found.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            found.append((cursor, end))
    return found


def _direction(name: str) -> str:
    for tag in ("HtoD", "DtoH", "DtoD"):
        if tag in name:
            return tag
    return "other"


def summarize(trace: dict) -> dict:
    """The table's figures from a Chrome trace (`torch.profiler`'s `export_chrome_trace`): per step window (the
    `offload.profile.step` ranges of the launching thread), in milliseconds, averaged over the steps."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == STEP and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"the trace has no {STEP!r} range")
    main = (steps[0]["pid"], steps[0]["tid"])
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]

    def clipped(selected) -> list[tuple[float, float]]:
        return _union([(max(s, ws), min(e, we)) for s, e in selected for ws, we in windows if min(e, we) > max(s, ws)])

    kernels = clipped((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memset"))
    copies = {
        direction: clipped(
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("cat") == "gpu_memcpy" and _direction(e.get("name", "")) == direction
        )
        for direction in ("HtoD", "DtoH", "DtoD")
    }
    all_copies = _union([i for spans in copies.values() for i in spans])
    window = _union(windows)
    idle = _minus(window, _union(kernels + all_copies))
    waits: dict[str, float] = {}
    host: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "user_annotation" or not name.startswith("offload.") or name == STEP:
            continue
        thread = "launching thread" if (e["pid"], e["tid"]) == main else "worker"
        if name.startswith("offload.wait") and thread == "launching thread":
            span = clipped([(e["ts"], e["ts"] + e["dur"])])
            waits[name] = waits.get(name, 0.0) + _length(_intersect(idle, span))
        # The host's work wherever it ran: the updates of a step overlap the next one's forward (or run after it).
        host[f"{name} ({thread})"] = host.get(f"{name} ({thread})", 0.0) + e["dur"]
    count = len(windows)
    gpu = None
    if kernels or all_copies:  # (a CPU run records no CUDA activity)
        gpu = {
            "busy (kernels)": _length(kernels) / 1e3 / count,
            **{f"copies {d}": _length(spans) / 1e3 / count for d, spans in copies.items()},
            "copies no kernel hides": _length(_minus(all_copies, kernels)) / 1e3 / count,
            "idle": _length(idle) / 1e3 / count,
            **{f"idle in {name}": value / 1e3 / count for name, value in sorted(waits.items())},
        }
    return {
        "steps": len(windows),
        "step_ms": statistics.median(end - start for start, end in windows) / 1e3,
        "gpu_ms": gpu,
        "host_ms": {name: value / 1e3 / count for name, value in sorted(host.items())},
    }


def small_trace(trace: dict) -> dict:
    """The trace without its kernels and operators: the steps, offload's ranges (both threads), the memcpys and the
    GPU's busy intervals merged into one event each (`gpu busy`), in Chrome's trace format."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kept = [
        {k: e[k] for k in ("name", "cat", "ph", "ts", "dur", "pid", "tid") if k in e}
        for e in events
        if (e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("offload."))
        or e.get("cat") == "gpu_memcpy"
    ]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memset")]
    if kernels:
        pid, tid = kernels[0]["pid"], kernels[0]["tid"]
        for start, end in _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]):
            kept.append({"name": "gpu busy", "cat": "kernel", "ph": "X", "ts": start, "dur": end - start, "pid": pid,
                         "tid": tid})  # fmt: skip
    return {"traceEvents": sorted(kept, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}


def profile_design(model, optimizer, offload, batch, step, steps: int, device: str) -> dict:
    """`steps` training steps (`step()` each) under the profiler: (summary, small trace)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, experimental_config=profiler_config_all_threads()) as prof:
        for _ in range(steps):
            with record_function(STEP):
                step()
                if device == "cuda":
                    torch.cuda.synchronize()  # the window holds the step's GPU work
        offload.synchronize()  # the last step's host updates, overlapped with nothing now, recorded too
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return summarize(trace), small_trace(trace)


def run(
    bench,
    preset: dict,
    device: str,
    out: Path,
    designs=PROFILE_DESIGNS,
    ratio: float = 0.5,
    steps: int = 2,
    command: str = "make gpu-report (its offload_profile part)",
):
    """Profile each of `designs` (benchmarks/offload.py's) at `ratio`; write `<out>.md`, `<out>.json`,
    `<out>_trace.json`, with `command`, the machine, the date and the load average before and after."""
    dims, accumulation = preset["dims"], preset["accumulation"]
    batch = torch.randint(0, dims["vocab_size"], (preset["batch"], preset["seq"]), generator=torch.Generator())
    batch = batch.to(device)
    result = {"date": utc_now(), "machine": machine(), "command": command, "ratio": ratio, "steps": steps}
    result.update(load_average_before=os.getloadavg(), designs={})
    result.update(batch=preset["batch"], seq=preset["seq"], accumulation=accumulation, model=dims)
    traces = {}
    for design in designs:
        model, optimizer, offload = bench.setup(bench.granular_name(ratio, design), dims, device)

        def one_step(model=model, optimizer=optimizer, offload=offload, design=design):
            bench.train_step(model, optimizer, batch, accumulation, device, offload, clip=bench.clips(design))

        for _ in range(preset["warmup"]):
            one_step()
        offload.synchronize()
        bench.synchronize(device)
        summary, trace = profile_design(model, optimizer, offload, batch, one_step, steps, device)
        offload.synchronize()
        result["designs"][design] = summary
        traces[design] = trace
        print(f"profile {design}: {summary['step_ms']:.1f} ms per step", flush=True)
        offload.remove()
        del model, optimizer, offload
        bench.free_memory(device)
    result["load_average_after"] = os.getloadavg()
    write_json(Path(f"{out}_trace.json"), {"designs": traces}, indent=None)
    publish(out, result, render_markdown(result))
    return result


def render_markdown(r: dict) -> str:
    m = r["machine"]
    designs = list(r["designs"])
    lines = [
        f"# Granular offload: where the step goes (ratio {r['ratio']})",
        "",
        f"Produced by `{r.get('command', 'make gpu-report')}` on {r['date']}: {m.get('gpu') or m['cpu']}; "
        f"{m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}; load average (1, 5, 15 min) before / after: "
        f"{load_averages(r)}. Model: {r['model']['num_hidden_layers']} layers, "
        f"hidden {r['model']['hidden_size']}; {r['accumulation']} micro-batches of {r['batch']} x {r['seq']} tokens "
        f"per step; {r['steps']} profiled steps after warm-up, milliseconds per step.",
        "",
        "| | " + " | ".join(designs) + " |",
        "|---|" + "---:|" * len(designs),
        "| step | " + " | ".join(f"{r['designs'][d]['step_ms']:.1f}" for d in designs) + " |",
    ]
    gpu_rows = sorted({name for d in designs for name in (r["designs"][d]["gpu_ms"] or {})})
    if not gpu_rows:
        lines.append("| GPU | " + " | ".join("no CUDA activity (a CPU run)" for _ in designs) + " |")
    for name in gpu_rows:
        cells = [f"{(r['designs'][d]['gpu_ms'] or {}).get(name, 0.0):.1f}" for d in designs]
        lines.append(f"| GPU {name} | " + " | ".join(cells) + " |")
    for name in sorted({name for d in designs for name in r["designs"][d]["host_ms"]}):
        cells = [f"{r['designs'][d]['host_ms'].get(name, 0.0):.1f}" for d in designs]
        lines.append(f"| host {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "GPU rows: the union of its kernels (busy), of its copies by direction, of the copies no kernel overlaps, of "
        "neither (idle), and the idle time during which the launching thread was in offload's named waits. Host "
        "rows: the time in each of offload's ranges by thread (ranges nest: a wait inside a phase counts in both).",
    ]
    return "\n".join(lines) + "\n"
