"""The host's phases of granular offload on this machine, and the step time they predict on a GPU.

    python scripts/bench_offload_host.py                # writes benchmarks/offload_host.{json,md}
    python scripts/bench_offload_host.py --deepspeed    # also DeepSpeed's DeepSpeedCPUAdam (compiles a C++ op: minutes)
    python scripts/bench_offload_host.py --smoke        # seconds: checks the script, not a result

What it measures, on blocks shaped like the GPU benchmark's (benchmarks/presets.py's GPU model: hidden 1536, FFN 4096,
25.2M parameters per block; fp32 masters, bf16 copies and gradient parts, as granular offload keeps them), each the
median of `--repeats` after a warm-up:

- the optimizer update, in parameters per second and GB/s of AdamW's state traffic (28 bytes per parameter: it reads
  the parameter, its gradient and both moments, and writes back the parameter and both moments): torch's AdamW
  `fused=True` (the fused CPU kernel), `foreach=True` and the for-loop, one block at a time; the fused one over
  `--blocks` blocks with 1, 2, ... host threads at once (`GranularOffload(host_threads=...)`); DeepSpeedCPUAdam with
  `--deepspeed` (its first use compiles its op; that time is recorded apart);
- the gradient accumulation of `grad_accumulation="host"`: a fp32 sum += a bf16 part (bytes of the sum read and
  written), and its norm;
- the copies: a bf16 part converted into a new fp32 gradient, and the fp32 masters copied into their bf16 copies to
  send (bytes written); into pinned memory where CUDA is available (pageable otherwise: this machine may have none).

The step-time model (`hf_p2r.distributed.offload.step_time`) then predicts the offloaded step on the GPU run of
benchmarks/gpu/offload.json (its no-offload step time, its measured bus bandwidth, its model): with this machine's
host rates, and with one scale factor on every host rate fitted to that run's measured step times of today's design
(its host was not measured; the factor says how much faster it is than this one), each design at ratios 0.25, 0.5
and 1.0, beside the measured figures.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks import presets
from benchmarks.harness import REPO, load_averages, machine, publish, utc_now
from hf_p2r.distributed.offload.step_time import DESIGNS, HostRates, OffloadStep, predict_step_seconds

ADAMW_BYTES = 28  # per fp32 parameter: reads parameter, gradient, two moments; writes parameter, two moments
RATIOS = (0.25, 0.5, 1.0)
GPU_RESULT = REPO / "benchmarks" / "gpu" / "offload.json"


def block_shapes(dims: dict) -> list[tuple[int, ...]]:
    """The parameter shapes of one decoder block of a Llama-shaped model (`dims` as presets.model gives)."""
    hidden, ffn = dims["hidden_size"], dims["intermediate_size"]
    kv = hidden // dims["num_attention_heads"] * dims["num_key_value_heads"]
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden)] + [
        (hidden, ffn),
        (hidden,),
        (hidden,),
    ]


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn()`, in seconds, after one warm-up call: what the host can do when it
    gets the cores (as `timeit` reports; this machine is shared, and a slower call measures the others' load)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def new_block(shapes, generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [torch.randn(shape, generator=generator) * 0.02 for shape in shapes]
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    return params, grads


def adamw(params, grads, **options) -> torch.optim.Optimizer:
    leaves = [torch.nn.Parameter(p) for p in params]
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    return torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.1, **options)


def measure_update(shapes, blocks: int, repeats: int, deepspeed: bool) -> dict:
    generator = torch.Generator().manual_seed(0)
    numel = sum(math.prod(shape) for shape in shapes)
    results = {}

    def record(name: str, seconds: float, parameters: int, **extra) -> None:
        results[name] = {
            "seconds": seconds,
            "parameters_per_s": parameters / seconds,
            "GBps": parameters * ADAMW_BYTES / seconds / 1e9,
            **extra,
        }
        print(f"update {name}: {parameters / seconds / 1e6:.0f} M parameters/s", flush=True)

    params, grads = new_block(shapes, generator)
    # At torch's intra-op thread count, then at 1 where it is more: on a shared machine whose cores are busy, threads
    # that wait for each other inside a kernel can make it slower than one thread (recorded, not hidden).
    intra_op = torch.get_num_threads()
    for threads in sorted({intra_op, 1}, reverse=True):
        suffix = "" if threads == intra_op else f", {threads} intra-op thread"
        torch.set_num_threads(threads)
        try:
            for name, options in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
                optimizer = adamw(params, grads, **options)
                record(name + suffix, timed(optimizer.step, repeats), numel, intra_op_threads=threads)
                del optimizer
            optimizer = adamw(params, grads, foreach=False)
            record(
                "torch for-loop" + suffix, timed(optimizer.step, max(1, repeats // 2)), numel, intra_op_threads=threads
            )
            del optimizer
        finally:
            torch.set_num_threads(intra_op)
    # Several blocks, stepped by 1, 2, ... threads at once (each block its own fused AdamW, as GranularOffload's).
    optimizers = [adamw(*new_block(shapes, generator), fused=True) for _ in range(blocks)]
    for threads in sorted({1, 2, min(4, os.cpu_count() or 1)}):
        with ThreadPoolExecutor(max_workers=threads) as pool:

            def step_all(pool=pool):
                for future in [pool.submit(optimizer.step) for optimizer in optimizers]:
                    future.result()

            record(f"torch fused, {blocks} blocks on {threads} thread(s)", timed(step_all, repeats), blocks * numel)
    optimizers.clear()
    if deepspeed:
        results.update(measure_deepspeed(params, grads, numel, repeats))
    return results


def measure_deepspeed(params, grads, numel: int, repeats: int) -> dict:
    """DeepSpeedCPUAdam (AdamW mode) on the same block: its first construction builds its C++ op (timed apart)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as error:
        return {"deepspeed": {"skipped": f"not importable: {error}"}}
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    start = time.perf_counter()
    try:
        optimizer = DeepSpeedCPUAdam(leaves, lr=1e-4, weight_decay=0.1, adamw_mode=True)
    except Exception as error:  # the op failed to build: recorded, not fatal
        return {"deepspeed": {"skipped": f"DeepSpeedCPUAdam failed: {type(error).__name__}: {error}"[:300]}}
    build = time.perf_counter() - start
    seconds = timed(optimizer.step, repeats)
    print(f"update DeepSpeedCPUAdam: {numel / seconds / 1e6:.0f} M parameters/s (op ready in {build:.0f} s)")
    return {
        "DeepSpeedCPUAdam": {
            "seconds": seconds,
            "parameters_per_s": numel / seconds,
            "GBps": numel * ADAMW_BYTES / seconds / 1e9,
            "first_use_seconds": build,
        }
    }


def measure_host_phases(shapes, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    pin = torch.cuda.is_available()
    numel = sum(math.prod(shape) for shape in shapes)
    total = [torch.randn(shape, generator=generator) for shape in shapes]
    part = [torch.randn(shape, generator=generator).to(torch.bfloat16) for shape in shapes]
    staged = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin).copy_(p) for shape, p in zip(shapes, part)]
    copies = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin) for shape in shapes]

    def accumulate():
        for t, p in zip(total, staged):
            t.add_(p)

    def norm():
        for t in total:
            torch.linalg.vector_norm(t)

    def convert():
        for p in staged:
            p.to(torch.float32, copy=True)

    def refresh():
        for c, t in zip(copies, total):
            c.copy_(t)

    phases = {
        "accumulate fp32 += bf16": (accumulate, 8),  # bytes of the sum read and written
        "norm fp32": (norm, 4),  # bytes read
        "convert bf16 -> new fp32": (convert, 4),  # bytes written
        "copy fp32 -> bf16 (to send)": (refresh, 2),  # bytes written
    }
    results = {}
    for name, (fn, per_element) in phases.items():
        seconds = timed(fn, repeats)
        results[name] = {"seconds": seconds, "GBps": numel * per_element / seconds / 1e9, "pinned": pin}
        print(f"{name}: {results[name]['GBps']:.2f} GB/s", flush=True)
    return results


def host_rates(update: dict, phases: dict) -> HostRates:
    """This machine's rates: the fastest update measured, the host phases as measured."""
    fastest = max(row["parameters_per_s"] for row in update.values() if "parameters_per_s" in row)
    return HostRates(
        update_parameters_per_second=fastest,
        accumulate_bytes_per_second=phases["accumulate fp32 += bf16"]["GBps"] * 1e9,
        copy_bytes_per_second=phases["copy fp32 -> bf16 (to send)"]["GBps"] * 1e9,
        norm_bytes_per_second=phases["norm fp32"]["GBps"] * 1e9,
    )


def scaled(rates: HostRates, memory: float, update: float | None = None) -> HostRates:
    """`rates` with the update rate times `update` (default `memory`) and every other rate times `memory`."""
    return HostRates(
        update_parameters_per_second=rates.update_parameters_per_second * (memory if update is None else update),
        accumulate_bytes_per_second=rates.accumulate_bytes_per_second * memory,
        copy_bytes_per_second=rates.copy_bytes_per_second * memory,
        norm_bytes_per_second=rates.norm_bytes_per_second * memory,
    )


def gpu_run(path: Path = GPU_RESULT) -> dict | None:
    """The GPU offload run to predict: {date, device, command, compute_s, bandwidth, dims, micro_batches, measured:
    {ratio: step seconds of today's design}} from benchmarks/gpu/offload.json, or None."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for design in (report.get("designs") or {}).values():
        result = design.get("result") or {}
        runs = (result.get("throughput") or {}).get("runs") or {}
        if "no offload" not in runs:
            continue
        measured = {}  # by the step-time model's design names
        for design, suffix in (("today", ""), ("today, device_chunked", " device_chunked")):
            for ratio in RATIOS:
                if run := runs.get(f"granular ratio {ratio}{suffix}"):
                    measured.setdefault(design, {})[str(ratio)] = statistics.median(run["step_s"])
        return {
            "date": result["date"],
            "device": result["machine"].get("gpu"),
            "command": result["command"],
            "compute_s": statistics.median(runs["no offload"]["step_s"]),
            "bandwidth": result["bandwidth"],
            "dims": result["model"],
            "micro_batches": result["throughput"]["accumulation"],
            "measured": measured,
        }
    return None


def predictions(run: dict, rates: HostRates, shapes) -> dict:
    """{design: {ratio: predicted step seconds}} for `run` (see `gpu_run`) with host `rates`."""
    layers = run["dims"]["num_hidden_layers"]
    per_block = sum(math.prod(shape) for shape in shapes)
    h2d, d2h = (run["bandwidth"][key] * 1e9 for key in ("host_to_device_GBps", "device_to_host_GBps"))
    table = {}
    for name, design in DESIGNS.items():
        table[name] = {}
        for ratio in RATIOS:
            count = int(ratio * layers + 0.5)
            step = OffloadStep(count * per_block, run["micro_batches"], count, layers)
            predicted = predict_step_seconds(run["compute_s"], step, design, rates, h2d, d2h)
            table[name][str(ratio)] = {"seconds": predicted.seconds, "parts": predicted.parts}
    return table


FACTORS = [0.25 * 2 ** (step / 4) for step in range(41)]  # 1/4 to 256, four per octave
# The fits kept: root-mean-square error of the log step time within this of the best fit's (or of 5%).
FIT_TOLERANCE = 0.05


def _fit_error(run: dict, rates: HostRates, shapes) -> float:
    table = predictions(run, rates, shapes)["today"]
    errors = [math.log(table[r]["seconds"] / seconds) ** 2 for r, seconds in run["measured"]["today"].items()]
    return math.sqrt(sum(errors) / len(errors))


def fit(run: dict, rates: HostRates, shapes) -> dict:
    """How much faster than this host the GPU run's host must have been for the model to reproduce its measured
    step times of today's design: the one factor on every rate that fits best, and the pairs (factor on the memory
    phases, factor on the update) whose fit is within `FIT_TOLERANCE` of the best pair's; the predictions of each
    design are given over those pairs (a band: one design's three step times cannot tell the update's rate from the
    sums'). Factors on a geometric grid from 1/4 to 256."""
    single = min(FACTORS, key=lambda f: _fit_error(run, scaled(rates, f), shapes))
    errors = {(a, b): _fit_error(run, scaled(rates, a, b), shapes) for a in FACTORS for b in FACTORS}
    best = min(errors.values())
    kept = [pair for pair, error in errors.items() if error <= max(best + FIT_TOLERANCE, 0.05)]
    band: dict[str, dict[str, list[float]]] = {}
    for a, b in kept:
        for name, row in predictions(run, scaled(rates, a, b), shapes).items():
            for ratio, cell in row.items():
                low, high = band.setdefault(name, {}).setdefault(ratio, [math.inf, 0.0])
                band[name][ratio] = [min(low, cell["seconds"]), max(high, cell["seconds"])]
    return {
        "single_factor": single,
        "single_error": _fit_error(run, scaled(rates, single), shapes),
        "best_pair": min(errors, key=errors.get),
        "best_pair_error": best,
        "pairs_kept": len(kept),
        "memory_factors": [min(a for a, _ in kept), max(a for a, _ in kept)],
        "update_factors": [min(b for _, b in kept), max(b for _, b in kept)],
        "band": band,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny blocks, one repeat: checks the script")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeedCPUAdam (builds its C++ op first)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks the threads share (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/offload_host)")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        print("bench_offload_host: --blocks and --repeats must be at least 1", file=sys.stderr)
        return 2
    dims = presets.TINY if args.smoke else presets.GPU
    repeats = 1 if args.smoke else args.repeats
    out = args.out or (REPO / "runs" / "offload_host_smoke" if args.smoke else REPO / "benchmarks" / "offload_host")
    shapes = block_shapes(dims)
    result = {
        "date": utc_now(),
        "machine": machine(),
        "command": " ".join(["scripts/bench_offload_host.py", *(argv if argv is not None else sys.argv[1:])]),
        "smoke": args.smoke,
        "load_average_before": os.getloadavg(),
        "block_parameters": sum(math.prod(shape) for shape in shapes),
        "dims": dims,
    }
    result["update"] = measure_update(shapes, args.blocks, repeats, args.deepspeed)
    result["phases"] = measure_host_phases(shapes, repeats)
    result["load_average_after"] = os.getloadavg()
    rates = host_rates(result["update"], result["phases"])
    result["host_rates"] = vars(rates)
    run = gpu_run()
    if run is not None:
        gpu_shapes = block_shapes(run["dims"])
        fitted = fit(run, rates, gpu_shapes)
        result["gpu_run"] = run
        result["predicted"] = {
            "this_host": predictions(run, rates, gpu_shapes),
            "fitted_host": predictions(run, scaled(rates, fitted["single_factor"]), gpu_shapes),
            "fit": fitted,
        }
    print(publish(out, result, render_markdown(result)))
    return 0


def render_markdown(r: dict) -> str:
    m = r["machine"]
    load = load_averages(r)
    lines = [
        "# Granular offload: the host's phases" + (" — smoke run (checks the script; not a result)" * r["smoke"]),
        "",
        f"Produced by `python {r['command']}` on {r['date']}. Machine: {m['cpu_count']} CPUs ({m['cpu']}, "
        f"{m.get('torch_threads', '?')} torch threads), torch {m['torch']}, {m['platform']}; load average (1, 5, 15 "
        f"min) before / after: {load}. Blocks of {r['block_parameters'] / 1e6:.1f}M parameters (hidden "
        f"{r['dims']['hidden_size']}, FFN {r['dims']['intermediate_size']}).",
        "",
        "## Optimizer update (fp32 AdamW; GB/s of its state traffic, 28 bytes per parameter)",
        "",
        "| update | M parameters/s | GB/s |",
        "|---|---:|---:|",
    ]
    for name, row in r["update"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | |")
            continue
        extra = f" (first use: {row['first_use_seconds']:.0f} s to build its op)" if "first_use_seconds" in row else ""
        lines.append(f"| {name}{extra} | {row['parameters_per_s'] / 1e6:,.0f} | {row['GBps']:.2f} |")
    fastest = max((row for row in r["update"].items() if "parameters_per_s" in row[1]), key=lambda x: x[1]["GBps"])
    lines += [
        "",
        f"Fastest here: **{fastest[0]}**. Rows without a thread count ran at torch's intra-op thread count "
        f"({m.get('torch_threads', '?')}); on a machine whose cores other processes keep busy (the load average "
        "above), threads that wait for each other inside one kernel can run slower than one, so compare rows of the "
        "same run only, and read the fastest as what this host does when it gets its cores.",
        "",
        "## Gradient accumulation and copies",
        "",
    ]
    lines += ["| phase | GB/s | pinned |", "|---|---:|---|"]
    for name, row in r["phases"].items():
        lines.append(f"| {name} | {row['GBps']:.2f} | {'yes' if row['pinned'] else 'no (no CUDA here)'} |")
    if "predicted" in r:
        run, predicted = r["gpu_run"], r["predicted"]
        fit = predicted["fit"]
        bandwidth = run["bandwidth"]
        lines += [
            "",
            f"## Predicted GPU step ({run['device']}, benchmarks/gpu/offload.json of {run['date']})",
            "",
            f"The step-time model (`hf_p2r.distributed.offload.step_time`) with that run's no-offload step "
            f"({run['compute_s']:.3f} s: {run['micro_batches']} micro-batches), its bus "
            f"({bandwidth['host_to_device_GBps']:.1f} / {bandwidth['device_to_host_GBps']:.1f} GB/s) and a host: this "
            f"one as measured above; or this one with every rate {fit['single_factor']:.1f}x (the one factor that "
            f"best reproduces the measured step times of today's design: that host was not measured; RMS error of "
            f"the log step time {fit['single_error']:.3f}); or, as a band, every pair of factors (memory phases "
            f"{fit['memory_factors'][0]:.2g}-{fit['memory_factors'][1]:.3g}x, update "
            f"{fit['update_factors'][0]:.2g}-{fit['update_factors'][1]:.3g}x: {fit['pairs_kept']} pairs) that "
            f"reproduces them within {FIT_TOLERANCE} of the best pair's error ({fit['best_pair_error']:.3f}). Seconds "
            "per step (ratio to no offload).",
            "",
            "| design | host | " + " | ".join(f"ratio {ratio}" for ratio in RATIOS) + " |",
            "|---|---|" + "---:|" * len(RATIOS),
        ]
        for name in DESIGNS:
            if measured := run["measured"].get(name):
                seconds = [measured.get(str(x)) for x in RATIOS]
                cells = [f"{s:.3f} s ({run['compute_s'] / s:.3f})" if s else "—" for s in seconds]
                lines.append(f"| {name} | **measured** | " + " | ".join(cells) + " |")
            for host, table in (("this one", predicted["this_host"]), ("one factor", predicted["fitted_host"])):
                row = table[name]
                cells = [
                    f"{row[str(x)]['seconds']:.3f} s ({run['compute_s'] / row[str(x)]['seconds']:.3f})" for x in RATIOS
                ]
                lines.append(f"| {name} | {host} | " + " | ".join(cells) + " |")
            band = fit["band"][name]
            cells = [
                f"{band[str(x)][0]:.3f}-{band[str(x)][1]:.3f} s ({run['compute_s'] / band[str(x)][1]:.2f}-"
                f"{run['compute_s'] / band[str(x)][0]:.2f})"
                for x in RATIOS
            ]
            lines.append(f"| {name} | band | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Predictions, not measurements, except the rows marked measured: `make gpu-report`'s offload part measures "
            "each design on a GPU. The model's device_chunked step is the bus alone (masters, gradients and moments in "
            "and out); the measured one shows what that leaves out.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
