"""Granular CPU offload on one GPU: throughput by offload ratio against no offload and against FSDP2's
`CPUOffloadPolicy`, the largest real model trainable at each ratio, and the host<->device copy bandwidth (the
physical limit), all measured in the same run.

    python scripts/bench_offload.py                          # H100/H200: writes benchmarks/offload.{json,md}
    python scripts/bench_offload.py --part throughput        # or `largest`: one half (each under ~5 min)
    python scripts/bench_offload.py --designs report         # the designs make gpu-report times (see DESIGNS)
    python scripts/bench_offload.py --part profile           # where the step goes (benchmarks/offload_profile.py)
    python scripts/bench_offload.py --page                   # benchmarks/offload.md from the latest GPU results
    python scripts/bench_offload.py --device cpu --smoke     # seconds on CPU: checks the script, not a result
    python scripts/bench_offload.py --device cpu --offload-optimizer both   # benchmarks/offload_cpu.{json,md}

Throughput: one model that fits, trained for `--steps` optimizer steps of `--accumulation` micro-batches each (bf16
autocast, AdamW with gradient clipping) as: no offload; GranularOffload at ratio 0 (hooks only), 0.25, 0.5, 1.0
(`compute_dtype=bfloat16`, `prefetch=1`; its own clip, `clip_grad_norm_`, as the trainer runs it); FSDP2 `fully_shard`
with `CPUOffloadPolicy` in a 1-rank process group (`MixedPrecisionPolicy(param_dtype=bfloat16)`). Each configuration is
built, warmed up and timed in turn in this one process; the figures are ratios to the no-offload run of the same
process. `--designs` picks the offload designs (`DESIGNS`, GranularOffload's options; issue 40's): `host` (the
default: gradients summed on the host, the CPU update of each block overlapped with the next forward, as the trainer
runs it; rows "granular ratio r"), `device_chunked` (the update on the GPU, `--chunk-mb` at a time, the state in
pinned host memory), `device_sums` (gradients summed on the device, sent once per step), `device_sums_delayed` (and
the update one step late), ... (rows "granular ratio r <design>"); `--offload-optimizer host|device_chunked|both` is
the older spelling of the first two.

On the CPU (`--device cpu`, throughput only) the compute device is the CPU: every copy is CPU to CPU and the two designs
differ only in the extra copies of device_chunked. Such a run checks both designs end to end on a real size; it says
nothing of the GPU comparison. It records the load average, as the machine may be shared, and runs one intra-op thread:
on a shared 2-core machine (load 11) two OpenMP threads made a step of its model take 15-20 s against 1.3 s with one.

Largest trainable: real models of the same layer shape with activation checkpointing, one full training step each,
searched by layer count from a prediction (from `estimate_device_bytes` and measured activations): upwards while a
count trains, downwards (by quarters) while it runs out of device memory, then by bisection until a count that
trains and one that does not are adjacent (`search_largest`). Every probe is recorded, with the host memory it used.

A count whose host memory would not fit is never tried: the kernel would OOM-kill the process and no result would be
written. Host memory is counted as the kernel counts it: the offloaded blocks' pinned slabs (rounded up to a power
of two by torch's allocator) are charged at what one pinned allocation measured at the start costs in /proc/meminfo
(the drop of MemAvailable, the rise of Shmem or Mlocked, whichever is largest), their pageable gradients and AdamW
moments at their size, all scaled up by the largest ratio of measured to estimated use of the probes so far; what
a probe may use is MemAvailable, read just before it, less a margin (`HOST_MARGIN`), and only half of that until a
probe of at least 1 GiB has trained and measured what the kernel counts.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import presets
from benchmarks.harness import REPO, free_port, machine, nbytes, publish, utc_now, write_text
from hf_p2r import P2RConfig, P2RForCausalLM
from hf_p2r.distributed.offload import (
    DEFAULT_CHUNK_BYTES,
    GranularOffload,
    decoder_layers,
    estimate_device_bytes,
    estimate_host_bytes,
    measure_activation_bytes,
    select_layers,
)

GIB = 2**30
RATIOS = (0.0, 0.25, 0.5, 1.0)
# The offload designs measured (GranularOffload's options, issue 40), each row "granular ratio R <design>" ("host":
# "granular ratio R"):
DESIGNS = {
    "host": {},  # the default: gradients summed on the host per micro-batch, blocks updated after the backward
    "device_chunked": {"optimizer_step": "device_chunked"},  # the update on the GPU, a chunk at a time
    "device_sums": {"grad_accumulation": "device"},  # summed on the device, sent once per step
    "device_sums_delayed": {"grad_accumulation": "device", "update": "delayed"},  # one step stale
    "device_sums_delayed_corrected": {
        "grad_accumulation": "device",
        "update": "delayed",
        "delay_correction": "error_feedback",
    },
    "device_sums_during_backward": {"grad_accumulation": "device", "update": "during_backward"},
    "device_sums_chunked": {"grad_accumulation": "device", "optimizer_step": "device_chunked"},
    "device_sums_threads4": {"grad_accumulation": "device", "host_threads": 4},
}
# Designs run without gradient clipping: they update blocks before the whole gradient's norm exists.
NO_CLIP = ("device_sums_during_backward",)
# What `make gpu-report`'s offload part measures (within its time limit).
REPORT_DESIGNS = ("host", "device_sums", "device_sums_delayed", "device_sums_chunked")
# Issue 40's targets on a GPU: tokens/s against no offload at ratios 0.5 and 1.0, full offload against FSDP2's.
TARGETS = {"0.5": 0.85, "1.0": 0.6, "fsdp2": 3.0}


def clips(design: str) -> bool:
    return design not in NO_CLIP


class LastMicroBatch:
    """`GranularOffload(last_micro_batch=...)` for `train_step`, which says before each forward."""

    last = True

    def __call__(self) -> bool:
        return self.last


# What the two CPU presets share: 2 sequences of a micro-batch, 2 micro-batches a step, 2 warm-up steps, 64 MiB copies
# for the bandwidth probe.
CPU_STEP = dict(batch=2, accumulation=2, warmup=2, bandwidth_bytes=64 * 2**20)
PRESETS = {
    # A ~0.5B real model (25M parameters per layer) for one H100/H200.
    "cuda": dict(
        dims=presets.GPU,
        batch=4,
        seq=2048,
        accumulation=8,
        steps=4,
        warmup=2,
        bandwidth_bytes=GIB,
        max_trials=8,
        max_layers=4096,  # 100B parameters: beyond any single GPU + 128 GB host
    ),
    # A CPU measurement (`--device cpu` without `--smoke`): throughput only, a model that trains in seconds a step.
    "cpu_run": dict(
        CPU_STEP, dims=presets.model(hidden=256, ffn=768, heads=8, kv_heads=4, layers=8, vocab=2048), seq=128, steps=5
    ),
    # Seconds on 2 CPU cores: checks every code path of the script.
    "cpu": dict(
        CPU_STEP,
        dims=presets.model(hidden=64, ffn=128, heads=4, kv_heads=2, layers=4, vocab=256),
        seq=32,
        steps=2,
        warmup=1,
        max_trials=2,
        max_layers=4,  # the smoke run has no memory limit
    ),
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()  # pinned host memory is cached too


def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> dict:
    """GB/s of host->device and device->host copies of `nbytes` (pinned host memory), median over `reps`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("host_to_device_GBps", target, host), ("device_to_host_GBps", host, target)):
        times = []
        for _ in range(reps + 1):
            synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
        result[name] = nbytes / statistics.median(times[1:]) / 1e9
    return result


# Host memory kept free under every probe: the larger of 10% of MemTotal and 4 GiB (the estimate leaves out the
# transient copies of building a model, the CUDA context's growth and other processes' needs).
HOST_MARGIN = (0.10, 4 * GIB)


def meminfo(text: str | None = None) -> dict[str, int]:
    """/proc/meminfo (or `text` in its format) in bytes: {"MemTotal": ..., "MemAvailable": ..., "Shmem": ...}."""
    text = Path("/proc/meminfo").read_text() if text is None else text
    info = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            info[name.strip()] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    if "MemAvailable" not in info or "MemTotal" not in info:
        raise OSError("/proc/meminfo has no MemAvailable or MemTotal line")
    return info


def host_budget_bytes(info: dict[str, int]) -> int:
    """Host bytes a probe may add: MemAvailable less the margin (`HOST_MARGIN`)."""
    fraction, least = HOST_MARGIN
    return info["MemAvailable"] - max(least, int(fraction * info["MemTotal"]))


def pinned_cost(device: str, nbytes: int = GIB) -> dict:
    """What the kernel charges for `nbytes` of torch's pinned host memory (1.0 per byte on the CPU, which pins
    nothing): one allocation, touched, against /proc/meminfo before and after. Pinned pages may be counted as shared
    memory (Shmem) or locked (Mlocked) and always leave MemAvailable; the largest of the three changes counts."""
    if device != "cuda":
        return {"bytes": nbytes, "factor": 1.0}
    free_memory(device)
    before = meminfo()
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer.fill_(1)
    after = meminfo()
    del buffer
    free_memory(device)
    changes = {
        "available_drop": before["MemAvailable"] - after["MemAvailable"],
        "shmem_rise": after.get("Shmem", 0) - before.get("Shmem", 0),
        "mlocked_rise": after.get("Mlocked", 0) - before.get("Mlocked", 0),
    }
    return {"bytes": nbytes, **changes, "factor": max(1.0, *(change / nbytes for change in changes.values()))}


def host_need_bytes(dims: dict, layers: int, ratio: float, dtype, pinned_factor: float) -> int:
    """Host bytes of a probe's offloaded blocks, pinned slabs charged at `pinned_factor`; see the module docstring."""
    model = shapes(dims, layers)
    offloaded = select_layers(model, ratio)
    total = estimate_host_bytes(model, offloaded, compute_dtype=dtype, pinned=True)
    block = nbytes(model.model.layers[0].parameters())
    pageable = 3 * block * len(offloaded)  # gradient, exp_avg, exp_avg_sq of each fp32 parameter (not pinned)
    return int((total - pageable) * pinned_factor) + pageable


def meta_model(dims: dict, layers: int) -> P2RForCausalLM:
    """A real P2R model with `layers` layers on the meta device (shapes only, no memory)."""
    config = P2RConfig(**{**dims, "num_hidden_layers": layers}, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        return P2RForCausalLM(config)


def shapes(dims: dict, layers: int) -> P2RForCausalLM:
    """For planning only: a meta model whose `layers` blocks are one module repeated (built in milliseconds at any
    depth; `select_layers` and `estimate_device_bytes` only count blocks and their parameters)."""
    model = meta_model(dims, 1)
    model.model.layers = torch.nn.ModuleList([model.model.layers[0]] * layers)
    return model


def build_model(
    dims: dict, layers: int, device: str, offloaded: list[int] | None = None, init_host: bool = True
) -> P2RForCausalLM:
    """A real P2R model with `layers` layers; blocks in `offloaded` are created in CPU memory, the rest on `device`.

    Created on the meta device and materialised in place, so a model larger than the GPU never passes through it.
    `init_host=False` leaves the CPU blocks uninitialised (fresh pages are zeros): the size search needs memory, not
    values, and initialising tens of GB on the CPU takes longer than the step.
    """
    model = meta_model(dims, layers)
    config = model.config
    offloaded = set(offloaded or ())
    for index, block in enumerate(decoder_layers(model)):
        block.to_empty(device="cpu" if index in offloaded else device)
    for module in (model.model.embed_tokens, model.model.norm, model.lm_head):
        module.to_empty(device=device)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers are computed, not loaded
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "cpu" and device != "cpu" and not init_host:
                continue
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.02)
    return model.train()


def train_step(model, optimizer, batch, accumulation: int, device: str, offload=None, clip: bool = True) -> None:
    for micro_batch in range(accumulation):
        if offload is not None and isinstance(offload.last_micro_batch, LastMicroBatch):
            offload.last_micro_batch.last = micro_batch == accumulation - 1
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        (loss / accumulation).backward()
    # The offload's clip takes the offloaded gradients' norms recorded as they left the device (the trainer's).
    if clip:
        (offload.clip_grad_norm_ if offload is not None else torch.nn.utils.clip_grad_norm_)(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def granular_name(ratio: float, design: str) -> str:
    """A throughput row's name: "granular ratio 0.5" (host step) or "granular ratio 0.5 device_chunked"."""
    return f"granular ratio {ratio}" + ("" if design == "host" else f" {design}")


def design_of(name: str) -> str:
    """The design of a granular row's name (`granular_name`'s inverse)."""
    parts = name.removeprefix("granular ratio ").split(" ", 1)
    return parts[1] if len(parts) > 1 else "host"


def setup(name: str, dims: dict, device: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """(model, optimizer, offload or None) for one throughput configuration."""
    layers = dims["num_hidden_layers"]
    model = build_model(dims, layers, device)
    hyper = dict(lr=1e-4, weight_decay=0.1, fused=True)
    if name == "no offload":
        return model, torch.optim.AdamW(model.parameters(), **hyper), None
    if name == "fsdp2 CPUOffloadPolicy":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        from hf_p2r.distributed import fully_shard_p2r

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if device == "cuda" else None
        fully_shard_p2r(
            model,
            mesh=init_device_mesh(device, (1,)),
            mp_policy=policy,
            offload_policy=CPUOffloadPolicy(pin_memory=device == "cuda"),
        )
        return model, torch.optim.AdamW(model.parameters(), **hyper), None
    ratio = float(name.split()[2])
    dtype = torch.bfloat16 if device == "cuda" else None
    offload = GranularOffload(
        model,
        ratio,
        device=device,
        compute_dtype=dtype,
        chunk_bytes=chunk_bytes,
        overlap_step=True,
        last_micro_batch=LastMicroBatch(),
        **DESIGNS[design_of(name)],
    )
    return model, offload.build_optimizer(**hyper), offload


def throughput(
    preset: dict,
    device: str,
    designs: tuple[str, ...] = ("host",),
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ratios: tuple[float, ...] = RATIOS,
) -> dict:
    dims, batch_size, seq, accumulation = preset["dims"], preset["batch"], preset["seq"], preset["accumulation"]
    batch = torch.randint(0, dims["vocab_size"], (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    granular = [granular_name(r, design) for design in designs for r in ratios]
    names = ["no offload", *granular, "fsdp2 CPUOffloadPolicy"]
    runs = {}
    for name in names:
        model, optimizer, offload = setup(name, dims, device, chunk_bytes)
        clip = not name.startswith("granular") or clips(design_of(name))
        for _ in range(preset["warmup"]):
            train_step(model, optimizer, batch, accumulation, device, offload, clip)
        if offload is not None:
            offload.synchronize()
        synchronize(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        copied = dict(offload.copied_bytes) if offload else None
        seconds = []
        for step in range(preset["steps"]):
            start = time.perf_counter()
            train_step(model, optimizer, batch, accumulation, device, offload, clip)
            if offload is not None and step == preset["steps"] - 1:
                offload.synchronize()  # the last step's overlapped block steps count too
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        step_s = statistics.median(seconds)
        run = {
            "tokens_per_s": accumulation * batch.numel() / step_s,
            "step_s": seconds,
            "clipped": clip,
            "peak_device_GiB": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None,
        }
        if offload:
            run["offloaded_blocks"] = offload.layers
            run["copied_GB_per_step"] = {
                key: (offload.copied_bytes[key] - copied[key]) / preset["steps"] / 1e9 for key in copied
            }
        runs[name] = run
        print(f"{name}: {run['tokens_per_s']:,.0f} tokens/s, peak {run['peak_device_GiB']} GiB", flush=True)
        if offload:
            offload.remove()
        del model, optimizer, offload
        free_memory(device)
    base = runs["no offload"]["tokens_per_s"]
    for run in runs.values():
        run["vs_no_offload"] = run["tokens_per_s"] / base
    return {
        "batch": batch_size,
        "seq": seq,
        "accumulation": accumulation,
        "steps": preset["steps"],
        "designs": list(designs),
        "design_options": {design: {k: str(v) for k, v in DESIGNS[design].items()} for design in designs},
        "ratios": list(ratios),
        "chunk_bytes": chunk_bytes,
        "runs": runs,
    }


def try_training(dims: dict, layers: int, ratio: float, batch, device: str) -> dict:
    """One full training step of a `layers`-layer real model with `ratio` of its blocks offloaded: {"fits": False on
    running out of device memory, "host_used": bytes MemAvailable fell by, measured with the model still alive}."""
    model = optimizer = offload = None
    free_memory(device)
    before = meminfo()["MemAvailable"]
    try:
        offloaded = select_layers(shapes(dims, layers), ratio)
        model = build_model(dims, layers, device, offloaded, init_host=False)
        model.activation_checkpointing_enable()
        dtype = torch.bfloat16 if device == "cuda" else None
        offload = GranularOffload(model, offloaded, device=device, compute_dtype=dtype)
        optimizer = offload.build_optimizer(lr=1e-4, fused=True)
        train_step(model, optimizer, batch, 1, device, offload)
        synchronize(device)
        return {"fits": True, "host_used": before - meminfo()["MemAvailable"]}
    except torch.OutOfMemoryError:
        return {"fits": False, "host_used": before - meminfo()["MemAvailable"]}
    finally:
        del model, optimizer, offload  # the hooks only reference the offload: all of it is garbage now
        free_memory(device)


def search_largest(probe, first: int, host_fits, max_probes: int) -> dict:
    """The largest count n for which `probe(n)` is True, searched from the guess `first`, for a `probe` that holds up
    to some n and not beyond (a training step that fits in device memory).

    Upwards from a count that fits by an eighth of the guess, a step that doubles at each count that fits again;
    downwards by quarters from one that does not (a first guess can be far too high); then by bisection once a count
    that fits and one that does not are known; at most `max_probes` calls.
    A count with `host_fits(n)` False is never probed (it could get the process OOM-killed): the search goes no
    higher than the largest count the host allows, and reports `host_bound` when that count fits. Returns
    {"largest_ok", "smallest_failed", "host_bound", "probes": [(n, probe(n)), ...] in the order they ran}.
    """
    ok = fail = None
    host_bound = False
    probes = []
    n, up = first, max(1, first // 8)
    while n >= 1 and len(probes) < max_probes:
        if not host_fits(n):
            low, high = ok or 0, n  # the largest count in [low, n) the host allows
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if host_fits(middle) else (low, middle)
            if low == (ok or 0):
                host_bound = ok is not None
                break
            n = low
        result = probe(n)
        probes.append((n, result))
        ok, fail = (n, fail) if result else (ok, n)
        if ok is not None and fail is not None:
            if fail - ok <= 1:
                break
            n = (ok + fail) // 2
        elif result:
            n, up = n + up, 2 * up
        else:
            n -= max(1, n // 4)
    return {"largest_ok": ok, "smallest_failed": fail, "host_bound": host_bound, "probes": probes}


def largest_count(fits, cap: int) -> int:
    """The largest n in 0..2*cap with fits(n), for a predicate that holds up to some n and not beyond."""
    if not fits(1):
        return 0
    n = 1
    while n < cap and fits(2 * n):
        n *= 2
    low, high = n, 2 * n
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_trainable(preset: dict, device: str) -> dict:
    dims, batch_size, seq = preset["dims"], preset["batch"], preset["seq"]
    batch = torch.randint(0, dims["vocab_size"], (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    dtype = torch.bfloat16 if device == "cuda" else None
    # Activations under checkpointing grow linearly with depth: measure two depths, as the step will hold them.
    measured = []
    for layers in (2, 4):
        model = build_model(dims, layers, device)
        model.activation_checkpointing_enable()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            measured.append(measure_activation_bytes(model, batch))
        del model
        free_memory(device)
    per_layer = (measured[1] - measured[0]) / 2
    fixed = measured[0] - 2 * per_layer
    budget = torch.cuda.get_device_properties().total_memory if device == "cuda" else 2 * GIB
    pinned = pinned_cost(device)
    print(f"largest: pinned host memory costs {pinned['factor']:.2f} bytes per byte: {pinned}", flush=True)
    # scale: the largest measured / estimated host use so far; measured: whether a probe that trained measured it.
    host = {"pinned_factor": pinned["factor"], "scale": 1.0, "measured": False}
    results = {}
    for ratio in RATIOS:

        def device_fits(layers: int, ratio=ratio) -> bool:
            model = shapes(dims, layers)
            activations = int(fixed + per_layer * layers)
            need = estimate_device_bytes(
                model, select_layers(model, ratio), activation_bytes=activations, compute_dtype=dtype
            )
            return need <= budget

        predicted = largest_count(device_fits, preset["max_layers"])
        results[str(ratio)] = _largest_at(ratio, predicted, dims, batch, device, host, preset)
    info = meminfo()
    return {
        "batch": batch_size,
        "seq": seq,
        "activation_checkpointing": True,
        "device_budget_GiB": budget / GIB,
        "host_available_GiB": info["MemAvailable"] / GIB,
        "host_total_GiB": info["MemTotal"] / GIB,
        "host_margin": {"fraction_of_total": HOST_MARGIN[0], "at_least_GiB": HOST_MARGIN[1] / GIB},
        "pinned_cost": pinned,
        "host_estimate_scale": host["scale"],
        "activation_bytes_per_layer": per_layer,
        "ratios": results,
    }


def _largest_at(ratio: float, predicted: int, dims: dict, batch, device: str, host: dict, preset: dict) -> dict:
    """`search_largest` at one ratio, from the device's prediction capped by the host; every probe recorded."""
    dtype = torch.bfloat16 if device == "cuda" else None
    trials = []

    def host_need(layers: int) -> int:
        return int(host_need_bytes(dims, layers, ratio, dtype, host["pinned_factor"]) * host["scale"])

    def host_fits(layers: int) -> bool:
        # What is available now, less the margin; half of it until a probe has measured what the kernel counts.
        return host_need(layers) <= host_budget_bytes(meminfo()) * (1.0 if host["measured"] else 0.5)

    def probe(layers: int) -> bool:
        need = host_need(layers)
        start = time.perf_counter()
        outcome = try_training(dims, layers, ratio, batch, device)
        trials.append(
            {
                "layers": layers,
                "fits": outcome["fits"],
                "seconds": time.perf_counter() - start,
                "host_estimated_GiB": need / GIB,
                "host_used_GiB": outcome["host_used"] / GIB,
            }
        )
        if need >= GIB:  # later estimates learn from what the kernel counted (above the noise)
            host["scale"] = max(host["scale"], host["scale"] * outcome["host_used"] / need)
            host["measured"] |= outcome["fits"]  # a probe that failed may have stopped before it used it all
        print(f"largest: ratio {ratio}: {trials[-1]}", flush=True)
        return outcome["fits"]

    host_limit = largest_count(host_fits, preset["max_layers"])
    found = search_largest(probe, min(predicted, host_limit), host_fits, preset["max_trials"])
    ok = found["largest_ok"]
    return {
        "predicted_layers": predicted,
        "host_limit_layers": host_limit,
        "largest_ok_layers": ok,
        "smallest_failed_layers": found["smallest_failed"],
        "host_bound": found["host_bound"],
        "trials": trials,
        "params_billion_at_ok": None if ok is None else _parameters(dims, ok) / 1e9,
    }


def _parameters(dims: dict, layers: int) -> int:
    model = shapes(dims, layers)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    return sum(p.numel() for p in model.parameters()) + (layers - 1) * block  # parameters() counts the block once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script (needs --device cpu)")
    parser.add_argument("--part", choices=["all", "throughput", "largest", "profile"], default="all")
    parser.add_argument("--out", type=Path, default=None, help="output path without suffix")
    parser.add_argument(
        "--designs",
        default=None,
        help=f"comma-separated offload designs to time at every ratio, of: {', '.join(DESIGNS)}; 'report' for "
        f"{','.join(REPORT_DESIGNS)} (what make gpu-report measures); default host",
    )
    parser.add_argument(
        "--offload-optimizer",
        choices=["host", "device_chunked", "both"],
        default=None,
        help="the designs host, device_chunked or both (as --designs; kept for the commands of earlier results)",
    )
    parser.add_argument("--ratios", default=None, help="comma-separated offload ratios (default 0,0.25,0.5,1.0)")
    parser.add_argument(
        "--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="device_chunked: MiB stepped at a time"
    )
    parser.add_argument(
        "--page",
        action="store_true",
        help="measure nothing: write benchmarks/offload.md from the latest GPU results (benchmarks/offload.json, "
        "benchmarks/gpu/offload.json: the newer), with their date and device",
    )
    args = parser.parse_args(argv)
    if args.page:
        path = write_page()
        print(f"bench_offload: wrote {path}")
        return 0
    designs = parse_designs(args.designs, args.offload_optimizer)
    ratios = parse_ratios(args.ratios)
    if isinstance(designs, str) or isinstance(ratios, str):
        print(f"bench_offload: {designs if isinstance(designs, str) else ratios}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_offload: needs a CUDA GPU and none is available (--device cpu --smoke checks the script)")
        return 1
    if args.device == "cpu" and not args.smoke and args.part == "largest":
        print("bench_offload: on CPU, throughput only (the largest model's search needs a device to run out of)")
        return 1
    if args.chunk_mb <= 0:
        print(f"bench_offload: --chunk-mb must be positive, got {args.chunk_mb}")
        return 1
    chunk_bytes = max(1, int(args.chunk_mb * 2**20))
    cpu_run = args.device == "cpu" and not args.smoke
    if args.part == "profile":
        from benchmarks import offload_profile

        out = args.out or Path("runs/offload_profile_smoke" if args.smoke else "benchmarks/gpu/offload_profile")
        preset = PRESETS["cpu_run" if cpu_run else args.device]
        chosen = offload_profile.PROFILE_DESIGNS if args.designs is None else designs
        command = " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)])
        steps = 1 if args.smoke else 2
        offload_profile.run(sys.modules[__name__], preset, args.device, out, chosen, steps=steps, command=command)
        print((out.with_suffix(".md")).read_text())
        return 0
    out = args.out or Path(
        "runs/offload_smoke" if args.smoke else "benchmarks/offload_cpu" if cpu_run else "benchmarks/offload"
    )
    preset = PRESETS["cpu_run" if cpu_run else args.device]
    if cpu_run:
        torch.set_num_threads(1)  # see the module docstring: OpenMP threads spinning on a shared machine
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)

    # FSDP2 needs a process group: one rank. GranularOffload accepts a world of size 1.
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
        result = {
            **previous,
            "date": utc_now(),
            "machine": machine(),
            "command": " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
            "model": preset["dims"],
            "load_average_before": os.getloadavg(),
            "bandwidth": copy_bandwidth(args.device, preset["bandwidth_bytes"]),
        }
        print(f"copy bandwidth: {result['bandwidth']}", flush=True)
        if args.part in ("all", "throughput"):
            result["throughput"] = throughput(preset, args.device, designs, chunk_bytes, ratios)
        result["load_average_after"] = os.getloadavg()
        if args.part == "largest" or (args.part == "all" and not cpu_run):
            result["largest"] = largest_trainable(preset, args.device)
    finally:
        dist.destroy_process_group()
    print(publish(out, result, render_markdown(result, args.smoke)))
    return 0


def parse_designs(text: str | None, optimizer: str | None) -> tuple[str, ...] | str:
    """--designs (or the older --offload-optimizer) as a tuple of `DESIGNS` names, or a one-line error."""
    if text is None:
        return {"both": ("host", "device_chunked"), "device_chunked": ("device_chunked",)}.get(optimizer, ("host",))
    if optimizer is not None:
        return "give --designs or --offload-optimizer, not both"
    names = REPORT_DESIGNS if text == "report" else tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in DESIGNS]
    if unknown or not names:
        return f"--designs: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(DESIGNS)}, report)"
    return names


def parse_ratios(text: str | None) -> tuple[float, ...] | str:
    if text is None:
        return RATIOS
    try:
        ratios = tuple(float(part) for part in text.split(",") if part)
    except ValueError:
        return f"--ratios: expected comma-separated numbers between 0 and 1, got {text!r}"
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        return f"--ratios: expected comma-separated numbers between 0 and 1, got {text!r}"
    return ratios


def target_line(runs: dict, design: str) -> str:
    """Issue 40's targets for one design's rows: ratio 0.5 and 1.0 against no offload, full offload against FSDP2."""
    parts = []
    for ratio in ("0.5", "1.0"):
        row = runs.get(granular_name(float(ratio), design))
        if row:
            parts.append(f"ratio {ratio} ≥ {TARGETS[ratio]} of no offload: **{row['vs_no_offload']:.3f}**")
    full, fsdp2 = runs.get(granular_name(1.0, design)), runs.get("fsdp2 CPUOffloadPolicy")
    if full and fsdp2:
        parts.append(
            f"full offload ≥ {TARGETS['fsdp2']:g}x FSDP2 CPUOffloadPolicy: **{full['tokens_per_s']:,.0f} vs "
            f"{fsdp2['tokens_per_s']:,.0f} tokens/s ({full['tokens_per_s'] / fsdp2['tokens_per_s']:.2f}x)**"
        )
    return f"Targets ({design}): " + ("; ".join(parts) or "no row measured") + "."


GPU_RESULTS = (Path("benchmarks/offload.json"), Path("benchmarks/gpu/offload.json"))
PAGE = Path("benchmarks/offload.md")


def gpu_results(paths=GPU_RESULTS) -> list[tuple[Path, dict]]:
    """The GPU throughput results on file: (path, result) for benchmarks/offload.json (this script's own CUDA run)
    and each design run of benchmarks/gpu/offload.json (`make gpu-report`'s offload part), newest first."""
    found = []
    for path in paths:
        try:
            data = json.loads((REPO / path).read_text())
        except (OSError, ValueError):
            continue
        results = [data] if "throughput" in data else [d.get("result") for d in (data.get("designs") or {}).values()]
        found += [(path, r) for r in results if r and "gpu" in r.get("machine", {}) and "throughput" in r]
    return sorted(found, key=lambda item: item[1]["date"], reverse=True)


def write_page(paths=GPU_RESULTS, page: Path = PAGE) -> Path:
    """benchmarks/offload.md: the latest GPU measurement (the newest result of `gpu_results`, with every design run
    of the same report beside it), its date and device, and where the other offload pages are."""
    found = gpu_results(paths)
    lines = ["# Granular CPU offload", ""]
    if not found:
        lines += ["No GPU result is on file yet: `make gpu-report` (or `python scripts/bench_offload.py`) writes one."]
    else:
        path, newest = found[0]
        same = [r for p, r in found if p == path and r["date"][:10] == newest["date"][:10]]
        lines += [
            f"Latest GPU measurement: **{newest['machine']['gpu']}**, {newest['date']}, from `{path}` "
            f"({'`make gpu-report`' if 'gpu' in path.parts else 'scripts/bench_offload.py'}). This page is written "
            "by `python scripts/bench_offload.py --page` from that file.",
        ]
        measured = set()
        for result in same:
            body = render_markdown(result, smoke=False).splitlines()
            body = [("#" + line) if line.startswith("## ") else line for line in body]
            lines += ["", "## " + body[2].removeprefix("Produced by ").rstrip("."), "", *body[3:]]
            measured |= {design_of(name) for name in result["throughput"]["runs"] if name.startswith("granular")}
        if missing := [design for design in DESIGNS if design not in measured]:
            lines += ["", f"Not measured on a GPU yet: the designs {', '.join(missing)} (benchmarks/offload_host.md "
                      "predicts them)."]  # fmt: skip
    lines += [
        "",
        "## Elsewhere",
        "",
        "- `benchmarks/gpu/offload_profile.md`: where the offloaded step's milliseconds go on a GPU (`make "
        "gpu-report`'s offload_profile part), when measured.",
        "- `benchmarks/offload_host.md`: the host's phases measured on a CPU machine and the step time they predict.",
        "- `benchmarks/offload_cpu.md`: both optimizer-step designs run end to end with the CPU as the compute device.",
        "",
        "To measure on one H100/H200: `make gpu-report` (all parts) or `python scripts/bench_offload.py --designs "
        "report --part throughput`, then `python scripts/bench_offload.py --page`.",
    ]
    text = "\n".join(lines) + "\n"
    write_text(REPO / page, text)
    return REPO / page


def render_markdown(r: dict, smoke: bool) -> str:
    m, dims = r["machine"], r["model"]
    cpu_run = "gpu" not in m and not smoke
    title = "# Granular CPU offload" + (" — CPU smoke run (checks the script; not a result)" if smoke else "")
    title += " — CPU run (compute device = CPU: checks both designs on a real size; no GPU figure)" if cpu_run else ""
    load = ""
    if "load_average_before" in r and "load_average_after" in r:
        before, after = (", ".join(f"{x:.2f}" for x in r[k]) for k in ("load_average_before", "load_average_after"))
        load = f" Load average (1, 5, 15 min) before: {before}; after: {after}."
    lines = [
        title,
        "",
        f"Produced by `python {r['command']}` on {r['date']}.",
        f"Machine: {m.get('gpu', m['cpu'])}; {m['cpu_count']} CPUs ({m['cpu']}, {m.get('torch_threads', '?')} torch "
        f"threads), torch {m['torch']}, {m['platform']}." + load,
        f"Layer shape: hidden {dims['hidden_size']}, FFN {dims['intermediate_size']}, {dims['num_attention_heads']} "
        f"heads ({dims['num_key_value_heads']} KV), vocab {dims['vocab_size']}.",
        "",
        f"Pinned copy bandwidth: host→device {r['bandwidth']['host_to_device_GBps']:.1f} GB/s, device→host "
        f"{r['bandwidth']['device_to_host_GBps']:.1f} GB/s.",
    ]
    if "throughput" in r:
        t = r["throughput"]
        lines += [
            "",
            f"## Throughput ({dims['num_hidden_layers']} layers; {t['accumulation']} micro-batches of {t['batch']} x "
            f"{t['seq']} tokens per optimizer step; median of {t['steps']} steps)",
            "",
            "| configuration | tokens/s | vs no offload | peak device GiB | H2D GB/step | D2H GB/step |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, run in t["runs"].items():
            copied = run.get("copied_GB_per_step", {})
            peak = "" if run["peak_device_GiB"] is None else f"{run['peak_device_GiB']:.2f}"
            lines.append(
                f"| {name} | {run['tokens_per_s']:,.0f} | {run['vs_no_offload']:.3f} | {peak} | "
                f"{copied.get('to_device', 0):.2f} | {copied.get('to_host', 0):.2f} |"
            )
        runs = t["runs"]
        designs = t.get("designs", ["host"])
        if any(not run.get("clipped", True) for run in runs.values()):
            lines += ["", "Rows of designs that update blocks during the backward run without gradient clipping."]
        if cpu_run or smoke:
            floor = runs.get(granular_name(0.0, designs[0]))
            lines += ["", "No GPU target is judged on a CPU run."]
            if floor:
                lines[-1] += (
                    f" Noise floor: ratio 0.0 (hooks only, nothing offloaded) ran at {floor['vs_no_offload']:.3f} of "
                    "no offload; differences within it say nothing."
                )
        for design in designs if not (cpu_run or smoke) else ():
            lines += ["", target_line(runs, design)]
        if {"host", "device_chunked"} <= set(designs) and all(
            granular_name(r, d) in runs for r in RATIOS for d in ("host", "device_chunked")
        ):
            chunk = f"{t['chunk_bytes'] / 2**20:g} MiB chunks"
            speed = {name: run["tokens_per_s"] for name, run in runs.items()}
            ratios = ", ".join(
                f"{r}: {speed[granular_name(r, 'device_chunked')] / speed[granular_name(r, 'host')]:.3f}x"
                for r in RATIOS
            )
            lines += ["", f"device_chunked ({chunk}) vs host step, tokens/s by ratio: {ratios}."]
    if "largest" in r:
        g = r["largest"]
        lines += [
            "",
            f"## Largest trainable real model (activation checkpointing, batch {g['batch']} x {g['seq']}; device "
            f"{g['device_budget_GiB']:.0f} GiB, host available {g['host_available_GiB']:.0f} GiB)",
            "",
        ]
        if "pinned_cost" in g:
            margin = g["host_margin"]
            lines += [
                f"Host guard: pinned memory charged at {g['pinned_cost']['factor']:.2f} bytes per byte (measured), "
                f"estimates scaled by {g['host_estimate_scale']:.2f} (measured / estimated use of the probes), "
                f"{margin['fraction_of_total']:.0%} of {g['host_total_GiB']:.0f} GiB (at least "
                f"{margin['at_least_GiB']:.0f} GiB) kept free.",
                "",
            ]
        lines += [
            "| ratio | predicted (device) | host limit | largest that trained | smallest that failed | parameters (B) "
            "| host-bound | probes in order (layers: ✓ trained, ✗ out of device memory; host GiB used) |",
            "|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for ratio, row in g["ratios"].items():
            params = "" if row["params_billion_at_ok"] is None else f"{row['params_billion_at_ok']:.2f}"
            probes = ", ".join(
                f"{t['layers']} {'✓' if t['fits'] else '✗'}"
                + (f" ({t['host_used_GiB']:.1f})" if "host_used_GiB" in t else "")
                for t in row["trials"]
            )
            lines.append(
                f"| {ratio} | {row['predicted_layers']} | {row['host_limit_layers']} | {row['largest_ok_layers']} | "
                f"{row['smallest_failed_layers']} | {params} | {'yes' if row['host_bound'] else 'no'} | {probes} |"
            )
        base = g["ratios"]["0.0"]["largest_ok_layers"]
        best = max((row["largest_ok_layers"] or 0) for row in g["ratios"].values())
        if base:
            lines += [
                "",
                f"Target: largest ≥ 3x the no-offload limit: **{best / base:.2f}x** ({best} vs {base} layers).",
            ]
    return "\n".join(lines) + "\n"
