"""Peak memory of the causal-LM loss, forward + backward: the plain path (`F.linear`, then transformers'
`ForCausalLMLoss`) against `hf_p2r.ops.linear_cross_entropy`'s chunked backend, across vocabulary x tokens.

Each (size, path) runs in a fresh process, so that no memory a previous run freed and the C allocator kept counts
for (or against) the next. The process makes its inputs (hidden states `tokens x hidden` and the head's weight
`vocab x hidden`, both requiring gradients), warms the path up on a tiny problem, then measures one loss forward +
backward: on CPU the resident-set high-water mark (VmHWM of /proc/self/status, reset to the current RSS through
/proc/self/clear_refs just before) minus the RSS before it; on CUDA `torch.cuda.max_memory_allocated` minus the
memory allocated before it. Both count the gradients the backward leaves in `.grad` (the same bytes for both paths).
It then times `--repeats` more forward + backward passes; the page reports the ratio of the paths' median times, taken
seconds apart on the same machine (a ratio, not a throughput claim).

    python scripts/bench_loss_memory.py                   # CPU sizes, writes benchmarks/loss_memory.{json,md}
    python scripts/bench_loss_memory.py --device cuda     # the same on a GPU (torch.cuda.max_memory_allocated)
    python scripts/bench_loss_memory.py --smoke --out /tmp/l   # one tiny size, seconds (the test suite's run)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import REPO, machine, utc_now, write_json, write_text

MIB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRESETS = {
    # (vocab, tokens) at one hidden size; sized for a CPU with ~20 GB free: the plain path holds about 12 bytes per
    # logit in bf16 (6 GiB at 4,096 x 131,072; 16,384 x 131,072 would need 24 GiB).
    "cpu": {
        "hidden": 1024,
        "sizes": [(32_768, 1_024), (32_768, 4_096), (32_768, 16_384), (131_072, 1_024), (131_072, 4_096)],
        "repeats": 2,
    },
    "cuda": {
        "hidden": 4096,
        "sizes": [(32_768, 4_096), (32_768, 16_384), (131_072, 4_096), (131_072, 16_384)],
        "repeats": 5,
    },
    "smoke": {"hidden": 32, "sizes": [(4096, 128)], "repeats": 1},  # one size: each path of it in its own process
}
PATHS = ("plain", "chunked")


def loss_fn(path: str, chunk_size: int | None):
    """The loss of `path`: (hidden, weight, labels) -> scalar."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hf_p2r.ops import linear_cross_entropy

    if path == "plain":
        return lambda h, w, labels: ForCausalLMLoss(F.linear(h, w), labels, w.shape[0])
    return lambda h, w, labels: linear_cross_entropy(h, w, labels, chunk_size=chunk_size, backend="chunked")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(spec: dict) -> dict:
    """One (size, path) measured in this process: peak bytes above the inputs, loss, seconds per pass."""
    device, dtype = spec["device"], DTYPES[spec["dtype"]]
    loss = loss_fn(spec["path"], spec["chunk_size"])
    hidden, vocab, tokens = spec["hidden"], spec["vocab"], spec["tokens"]

    def make(vocab_size: int, token_count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(1, token_count, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_()
        w = (torch.randn(vocab_size, hidden, generator=g) * hidden**-0.5).to(device=device, dtype=dtype)
        labels = torch.randint(0, vocab_size, (1, token_count), generator=g).to(device)
        return h, w.requires_grad_(), labels

    def step(h, w, labels) -> float:
        h.grad = w.grad = None
        value = loss(h, w, labels)
        value.backward()
        return value.item()

    step(*make(64, 8))  # kernels loaded, thread pools started: not part of the loss's memory
    h, w, labels = make(vocab, tokens)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        value = step(h, w, labels)
        peak = torch.cuda.max_memory_allocated() - before
        method = "torch.cuda.max_memory_allocated"
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            method = "VmHWM after clear_refs"
        except OSError:
            method = "VmHWM (not reset: clear_refs refused)"
        before = _status_kib("VmRSS")
        value = step(h, w, labels)
        peak = (_status_kib("VmHWM") - before) * 1024
    seconds = []
    for _ in range(spec["repeats"]):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(h, w, labels)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    weight_grad = w.grad.float()
    return {
        "peak_bytes": peak,
        "method": method,
        "loss": value,
        "weight_grad_norm": weight_grad.norm().item(),
        "seconds": seconds,
        "torch_threads": torch.get_num_threads(),
    }


def run_worker(spec: dict) -> dict:
    """`worker(spec)` in a fresh Python process started from the repository root."""
    load_before = os.getloadavg()[0]
    command = [sys.executable, "-m", "benchmarks.loss_memory", "--worker", json.dumps(spec)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{spec}: worker exited {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def measure(args: argparse.Namespace) -> dict:
    preset = dict(PRESETS["smoke" if args.smoke else args.device])
    hidden = args.hidden or preset["hidden"]
    sizes = preset["sizes"]
    if args.vocab or args.tokens:
        vocabs = args.vocab or sorted({v for v, _ in sizes})
        sizes = [(v, t) for v in vocabs for t in args.tokens or sorted({t for w, t in sizes if w == v})]
    repeats = args.repeats if args.repeats is not None else preset["repeats"]
    rows = []
    for vocab, tokens in sizes:
        chunk_size = min(args.chunk_size or hidden, tokens)  # the op's default: the hidden size
        row = {"vocab": vocab, "tokens": tokens, "hidden": hidden, "chunk_size": chunk_size}
        for path in PATHS:
            spec = dict(
                path=path,
                device=args.device,
                dtype=args.dtype,
                hidden=hidden,
                vocab=vocab,
                tokens=tokens,
                chunk_size=args.chunk_size,
                repeats=repeats,
            )
            row[path] = run_worker(spec)
            print(
                f"vocab {vocab:,} tokens {tokens:,} {path}: peak {row[path]['peak_bytes'] / MIB:,.0f} MiB, "
                f"{statistics.median(row[path]['seconds'] or [float('nan')]):.3f} s",
                flush=True,
            )
        rows.append(summarise(row, DTYPES[args.dtype]))
    return {
        "date": utc_now(),
        "machine": machine(),
        "config": {
            "device": args.device,
            "dtype": args.dtype,
            "hidden": hidden,
            "repeats": repeats,
            "smoke": args.smoke,
            "chunk_size": args.chunk_size,
        },
        "rows": rows,
    }


def summarise(row: dict, dtype: torch.dtype) -> dict:
    """`row` with what the page shows: the logits' bytes, the inputs' and gradients' bytes, the ratios."""
    plain, chunked = row["plain"], row["chunked"]
    element = torch.empty((), dtype=dtype).element_size()
    row["logits_fp32_bytes"] = row["tokens"] * row["vocab"] * 4
    row["gradient_bytes"] = (row["tokens"] + row["vocab"]) * row["hidden"] * element
    row["memory_ratio_plain_vs_chunked"] = plain["peak_bytes"] / chunked["peak_bytes"]
    if plain["seconds"] and chunked["seconds"]:
        row["time_ratio_chunked_vs_plain"] = statistics.median(chunked["seconds"]) / statistics.median(plain["seconds"])
    else:
        row["time_ratio_chunked_vs_plain"] = None
    row["loss_relative_difference"] = abs(chunked["loss"] - plain["loss"]) / abs(plain["loss"])
    return row


def render_markdown(result: dict) -> str:
    c, m = result["config"], result["machine"]
    loads = [x for row in result["rows"] for path in PATHS for x in row[path]["load_average"]]
    methods = sorted({row[path]["method"] for row in result["rows"] for path in PATHS})
    command = "scripts/bench_loss_memory.py" + (" --smoke" if c["smoke"] else f" --device {c['device']}")

    def time_ratio(row: dict) -> str:
        return "–" if row["time_ratio_chunked_vs_plain"] is None else f"{row['time_ratio_chunked_vs_plain']:.2f}"

    lines = [
        "# Peak memory of the causal-LM loss: plain vs chunked linear cross-entropy",
        "",
        f"Produced by `{command}` on {result['date']}.",
        f"Machine: {m.get('gpu', m['cpu'])}; {m['cpu_count']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads), {m['platform']}. Load average (1 min) around the runs: "
        f"{min(loads):.1f}–{max(loads):.1f}.",
        f"Loss forward + backward of hidden states ({c['hidden']} wide) through the head's weight, {c['dtype']}, "
        f"on {c['device']}; plain = `F.linear` then transformers' `ForCausalLMLoss` (every logit, upcast to fp32); "
        'chunked = `hf_p2r.ops.linear_cross_entropy(..., backend="chunked")` (one chunk\'s logits at a time). '
        f"Each size and path in a fresh process; peak = {', '.join(methods)}, minus the memory before the pass (the "
        f"inputs); time = median of {c['repeats']} passes after it, the two paths' processes run one after the other.",
        "",
        "| vocab | tokens | chunk | fp32 logits | gradients | plain peak | chunked peak | plain / chunked | "
        "time chunked / plain | loss rel. diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['vocab']:,} | {r['tokens']:,} | {r['chunk_size']:,} | {r['logits_fp32_bytes'] / MIB:,.0f} MiB | "
            f"{r['gradient_bytes'] / MIB:,.0f} MiB | {r['plain']['peak_bytes'] / MIB:,.0f} MiB | "
            f"{r['chunked']['peak_bytes'] / MIB:,.0f} MiB | {r['memory_ratio_plain_vs_chunked']:.2f} | "
            f"{time_ratio(r)} | {r['loss_relative_difference']:.1e} |"
            for r in result["rows"]
        ),
        "",
        "*fp32 logits* is tokens x vocab x 4 bytes, one copy of what the plain path upcasts; *gradients* the bytes of "
        "the hidden states' and the weight's gradients, which both paths leave in `.grad` and both peaks count. The "
        "chunked path also holds, from its forward to its backward, the weight's gradient summed in fp32 over the "
        "chunks; its peak grows with vocab x hidden and one chunk, not with tokens x vocab.",
        "",
    ]
    if max(loads) > m["cpu_count"]:
        lines += [
            f"The load average exceeded the {m['cpu_count']} cores (other jobs on the machine): the time ratios are "
            "noisy, the peaks are not (memory does not depend on the load). Rerun on an idle machine for times.",
            "",
        ]
    if c["device"] == "cpu":
        lines += [
            "CPU figures only: GPU peaks (`--device cuda`, torch.cuda.max_memory_allocated) are pending a run on a "
            "GPU; "
            'there the loss can also use Liger-Kernel\'s fused kernel (`backend="auto"`), not measured here.',
            "",
        ]
    return "\n".join(lines)


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--hidden", type=int, help="hidden size (default: the device's preset)")
    parser.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes (default: the device's preset)")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default: the device's preset)")
    parser.add_argument("--chunk-size", type=int, help="tokens per chunk (default: the op's, the hidden size)")
    parser.add_argument("--repeats", type=int, help="timed passes per size and path after the measured one")
    parser.add_argument("--smoke", action="store_true", help="one tiny size, one repeat: seconds (the tests' run)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "loss_memory")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a JSON spec: measure one (size, path), print JSON
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_loss_memory: --device cuda needs a CUDA device; none is available", file=sys.stderr)
        return 1
    result = measure(args)
    markdown = render_markdown(result)
    write_json(args.out.with_suffix(".json"), result)
    write_text(args.out.with_suffix(".md"), markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
