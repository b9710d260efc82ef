"""Training throughput and training-state bytes: P2R (real) vs transformers' Llama, and pseudo vs real.

All three models have identical dimensions and attention implementation and run in ONE process, interleaved round by
round (A, B, C, A, B, C, ...), so a ratio compares runs taken seconds apart and holds when the machine drifts. Each
round times `--steps` full training steps (forward, backward, AdamW step, zero_grad) on the same batch; the ratios
reported are medians over rounds of per-round ratios.

    python scripts/bench_throughput.py                       # CPU preset, writes benchmarks/throughput.{json,md}
    python scripts/bench_throughput.py --device cuda         # GPU preset (bf16 autocast, sdpa)
    python scripts/bench_throughput.py --preset tiny --rounds 1 --warmup 0 --out /tmp/t   # smoke run (seconds)
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_p2r import P2RConfig, P2RForCausalLM

PRESETS = {
    # Seconds in all: for checking the script end to end (tests/test_bench_throughput.py), not for measuring.
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=128,
        batch=2,
        seq=16,
    ),
    # Small enough for 2 CPU cores, large enough that a step is matmul-bound (tens of ms).
    "cpu": dict(
        hidden_size=256,
        intermediate_size=704,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=8,
        vocab_size=8192,
        batch=4,
        seq=256,
    ),
    # A ~0.5B real model, for one H100/H200.
    "cuda": dict(
        hidden_size=1536,
        intermediate_size=4096,
        num_attention_heads=12,
        num_key_value_heads=4,
        num_hidden_layers=16,
        vocab_size=32000,
        batch=8,
        seq=2048,
    ),
}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state, measured on the tensors themselves."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {"parameters": params, "gradients": grads, "optimizer": state, "total": params + grads + state}


class Runner:
    """One model + optimizer + batch; `run(steps)` times `steps` training steps."""

    def __init__(self, name: str, model: torch.nn.Module, batch: torch.Tensor, device: str, autocast_dtype):
        self.name, self.batch, self.device, self.autocast_dtype = name, batch, device, autocast_dtype
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.tokens_per_s: list[float] = []

    def step(self) -> None:
        with torch.autocast(self.device, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            loss = self.model(self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep grads allocated: the state measured is the training state

    def run(self, steps: int) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        rate = steps * self.batch.numel() / (time.perf_counter() - start)
        self.tokens_per_s.append(rate)
        return rate


def interleave(runners: list[Runner], rounds: int, steps: int, warmup: int) -> dict[str, Runner]:
    """Warm every runner up untimed, then time `steps` steps of each per round, the order rotating round by round so
    no model always runs first (caches, clock boost); returns the runners by name."""
    for runner in runners:
        for _ in range(warmup):
            runner.step()
        runner.tokens_per_s.clear()
    for round_idx in range(rounds):
        shift = round_idx % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.run(steps)
        rates = ", ".join(f"{r.name} {r.tokens_per_s[-1]:,.0f} tok/s" for r in runners)
        print(f"round {round_idx + 1}/{rounds}: {rates}", flush=True)
    return {runner.name: runner for runner in runners}


def ratio_summary(by_name: dict[str, Runner], a: str, b: str, target: str) -> dict:
    """Median, min and max over rounds of the per-round tokens/s ratio a / b."""
    values = [x / y for x, y in zip(by_name[a].tokens_per_s, by_name[b].tokens_per_s)]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "target": target}


def expected_state_ratio(real_model: torch.nn.Module, num_unique_layers: int) -> float:
    """Pseudo/real training-state ratio: (non-layer params + k blocks) / (non-layer params + L blocks)."""
    depth = len(real_model.model.layers)
    block = sum(p.numel() for p in real_model.model.layers[0].parameters())
    non_layer = sum(p.numel() for p in real_model.parameters()) - block * depth
    return (non_layer + num_unique_layers * block) / (non_layer + depth * block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model and batch sizes (default: the device's)")
    parser.add_argument("--attn", default="sdpa", help="attention implementation for all models (sdpa, eager, ...)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3, help="training steps per model per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--num-unique-layers", type=int, default=1, help="k of the pseudo model")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/throughput"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_throughput: --device cuda needs a CUDA device; none is available", file=sys.stderr)
        return 1

    preset = dict(PRESETS[args.preset or args.device])
    batch_size, seq = preset.pop("batch"), preset.pop("seq")
    dims = dict(preset, max_position_embeddings=seq, tie_word_embeddings=False)
    autocast_dtype = torch.bfloat16 if args.device == "cuda" else None
    torch.manual_seed(0)
    batch = torch.randint(0, dims["vocab_size"], (batch_size, seq), device=args.device)

    runners = [
        Runner("llama", LlamaForCausalLM(LlamaConfig(**dims)), batch, args.device, autocast_dtype),
        Runner("p2r_real", P2RForCausalLM(P2RConfig(**dims)), batch, args.device, autocast_dtype),
        Runner(
            "p2r_pseudo",
            P2RForCausalLM(P2RConfig(**dims, share_layers=True, num_unique_layers=args.num_unique_layers)),
            batch,
            args.device,
            autocast_dtype,
        ),
    ]
    for runner in runners:
        runner.model.set_attn_implementation(args.attn)
    by_name = interleave(runners, args.rounds, args.steps, args.warmup)

    state = {name: training_state_bytes(r.model, r.optimizer) for name, r in by_name.items()}

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            **dims,
            "batch": batch_size,
            "seq": seq,
            "attn_implementation": args.attn,
            "dtype": "bf16 autocast" if autocast_dtype else "fp32",
            "device": args.device,
            "preset": args.preset or args.device,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "pseudo_num_unique_layers": args.num_unique_layers,
        },
        "tokens_per_s_median": {name: statistics.median(r.tokens_per_s) for name, r in by_name.items()},
        "tokens_per_s": {name: r.tokens_per_s for name, r in by_name.items()},
        "ratio_real_vs_llama": ratio_summary(by_name, "p2r_real", "llama", ">= 1.00"),
        "ratio_pseudo_vs_real": ratio_summary(by_name, "p2r_pseudo", "p2r_real", ">= 0.98"),
        "training_state_bytes": state,
        "state_ratio_pseudo_vs_real": {
            "measured": state["p2r_pseudo"]["total"] / state["p2r_real"]["total"],
            "expected": expected_state_ratio(by_name["p2r_real"].model, args.num_unique_layers),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render_markdown(result))
    print(render_markdown(result))
    return 0


def render_markdown(r: dict) -> str:
    c, m = r["config"], r["machine"]
    mib = 2**20

    preset = f" --preset {c['preset']}" if c.get("preset", c["device"]) != c["device"] else ""

    def ratio_row(name: str, key: str) -> str:
        x = r[key]
        return f"| {name} | {x['median']:.3f} | {x['min']:.3f} – {x['max']:.3f} | {x['target']} |"

    lines = [
        "# Training throughput: P2R vs Llama, pseudo vs real",
        "",
        f"Produced by `scripts/bench_throughput.py --device {c['device']}{preset}` on {r['date']}.",
        *(
            ["CPU numbers: GPU throughput (`--device cuda`, bf16, a ~0.5B model) is pending a run on a GPU."]
            if c["device"] == "cpu"
            else []
        ),
        f"Machine: {m.get('gpu', m['cpu'])}; {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"{m['platform']}.",
        f"Model: hidden {c['hidden_size']}, FFN {c['intermediate_size']}, {c['num_attention_heads']} heads "
        f"({c['num_key_value_heads']} KV), {c['num_hidden_layers']} layers, vocab {c['vocab_size']}; batch "
        f"{c['batch']} x {c['seq']} tokens; {c['dtype']}; attention `{c['attn_implementation']}`; pseudo model "
        f"k = {c['pseudo_num_unique_layers']}. {c['rounds']} interleaved rounds of {c['steps_per_round']} training "
        "steps (forward + backward + AdamW) per model.",
        "",
        "| model | median tokens/s |",
        "|---|---:|",
        *(f"| {name} | {value:,.0f} |" for name, value in r["tokens_per_s_median"].items()),
        "",
        "| ratio (per round, same process) | median | min – max | target |",
        "|---|---:|---:|---|",
        ratio_row("P2R real / Llama", "ratio_real_vs_llama"),
        ratio_row("P2R pseudo / P2R real", "ratio_pseudo_vs_real"),
        "",
        "| training state (measured tensors) | parameters | gradients | AdamW state | total |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {s['parameters'] / mib:,.1f} MiB | {s['gradients'] / mib:,.1f} MiB | "
            f"{s['optimizer'] / mib:,.1f} MiB | {s['total'] / mib:,.1f} MiB |"
            for name, s in r["training_state_bytes"].items()
        ),
        "",
        f"Pseudo / real training-state bytes: measured {r['state_ratio_pseudo_vs_real']['measured']:.4f}, expected "
        f"(embeddings + head + k blocks) / (embeddings + head + L blocks) = "
        f"{r['state_ratio_pseudo_vs_real']['expected']:.4f}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
