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
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import presets
from benchmarks.harness import (
    Runner,
    interleave,
    machine,
    nbytes,
    optimizer_state_bytes,
    ratio_summary,
    utc_now,
    write_json,
    write_text,
)
from hf_p2r import P2RConfig, P2RForCausalLM

PRESETS = {
    "tiny": dict(presets.TINY, batch=2, seq=16),
    "cpu": dict(presets.CPU, batch=4, seq=256),
    "cuda": dict(presets.GPU, batch=8, seq=2048),
}


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state, measured on the tensors themselves."""
    params = nbytes(model.parameters())
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    state = optimizer_state_bytes(optimizer)
    return {"parameters": params, "gradients": grads, "optimizer": state, "total": params + grads + state}


def expected_state_ratio(real_model: torch.nn.Module, num_unique_layers: int) -> float:
    """Pseudo/real training-state ratio: (non-layer params + k blocks) / (non-layer params + L blocks)."""
    depth = len(real_model.model.layers)
    block = sum(p.numel() for p in real_model.model.layers[0].parameters())
    non_layer = sum(p.numel() for p in real_model.parameters()) - block * depth
    return (non_layer + num_unique_layers * block) / (non_layer + depth * block)


def command_line(doc: str, table: dict, out: str, rounds: int, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The command line of a throughput benchmark (this one, the MoE one): its presets (`table`), output and run
    lengths."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(table), help="model and batch sizes (default: the device's)")
    parser.add_argument("--attn", default="sdpa", help="attention implementation for all models (sdpa, eager, ...)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps, help="training steps per model per round")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per model first")
    parser.add_argument("--num-unique-layers", type=int, default=1, help="k of the pseudo model")
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


def prepare(args: argparse.Namespace, table: dict, script: str) -> tuple[dict, torch.Tensor, torch.dtype] | None:
    """(the model fields of `args`' preset in `table`, the batch of token ids, the autocast dtype or None); None, with
    a line on stderr, when --device cuda finds no CUDA device."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: --device cuda needs a CUDA device; none is available", file=sys.stderr)
        return None
    fields = dict(table[args.preset or args.device])
    batch_size, seq = fields.pop("batch"), fields.pop("seq")
    autocast_dtype = torch.bfloat16 if args.device == "cuda" else None
    torch.manual_seed(0)
    batch = torch.randint(0, fields["vocab_size"], (batch_size, seq), device=args.device)
    return fields, batch, autocast_dtype


def measure(runners: list[Runner], args: argparse.Namespace, dims: dict, **implementations: str) -> dict:
    """Time `runners` (the baseline, P2R real, P2R pseudo, in that order) in interleaved rounds: the result, with the
    ratios real / baseline and pseudo / real and the training state of each. `implementations` (after the attention's
    in the config): any other kernels chosen for all models."""
    for runner in runners:
        runner.model.set_attn_implementation(args.attn)
    by_name = interleave(runners, args.rounds, args.steps, args.warmup)
    baseline, real, pseudo = (runner.name for runner in runners)
    batch_size, seq = runners[0].batch.shape
    state = {name: training_state_bytes(r.model, r.optimizer) for name, r in by_name.items()}
    return {
        "date": utc_now(),
        "machine": machine(),
        "config": {
            **dims,
            "batch": batch_size,
            "seq": seq,
            "attn_implementation": args.attn,
            **implementations,
            "dtype": "bf16 autocast" if runners[0].autocast_dtype else "fp32",
            "device": args.device,
            "preset": args.preset or args.device,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "pseudo_num_unique_layers": args.num_unique_layers,
        },
        "tokens_per_s_median": {name: statistics.median(r.tokens_per_s) for name, r in by_name.items()},
        "tokens_per_s": {name: r.tokens_per_s for name, r in by_name.items()},
        f"ratio_real_vs_{baseline}": ratio_summary(by_name, real, baseline, ">= 1.00"),
        "ratio_pseudo_vs_real": ratio_summary(by_name, pseudo, real, ">= 0.98"),
        "training_state_bytes": state,
        "state_ratio_pseudo_vs_real": {
            "measured": state[pseudo]["total"] / state[real]["total"],
            "expected": expected_state_ratio(by_name[real].model, args.num_unique_layers),
        },
    }


def write(out: Path, result: dict, markdown: str) -> None:
    """OUT.json and OUT.md, and the page on stdout."""
    write_json(out.with_suffix(".json"), result)
    write_text(out.with_suffix(".md"), markdown)
    print(markdown)


def main(argv: list[str] | None = None) -> int:
    args = command_line(__doc__, PRESETS, "benchmarks/throughput", rounds=12, steps=3, warmup=2).parse_args(argv)
    prepared = prepare(args, PRESETS, "bench_throughput")
    if prepared is None:
        return 1
    fields, batch, autocast_dtype = prepared
    dims = dict(fields, max_position_embeddings=batch.shape[1], tie_word_embeddings=False)
    pseudo = P2RConfig(**dims, share_layers=True, num_unique_layers=args.num_unique_layers)
    runners = [
        Runner("llama", LlamaForCausalLM(LlamaConfig(**dims)), batch, args.device, autocast_dtype),
        Runner("p2r_real", P2RForCausalLM(P2RConfig(**dims)), batch, args.device, autocast_dtype),
        Runner("p2r_pseudo", P2RForCausalLM(pseudo), batch, args.device, autocast_dtype),
    ]
    result = measure(runners, args, dims)
    write(args.out, result, render_markdown(result))
    return 0


def produced_by(r: dict, script: str) -> str:
    """The page's first line: the command (its --preset where not the device's) and the date."""
    c = r["config"]
    preset = f" --preset {c['preset']}" if c.get("preset", c["device"]) != c["device"] else ""
    return f"Produced by `{script} --device {c['device']}{preset}` on {r['date']}."


def machine_line(m: dict) -> str:
    return (
        f"Machine: {m.get('gpu', m['cpu'])}; {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"{m['platform']}."
    )


def tables(r: dict, ratios: list[tuple[str, str]], noise_warning: bool = False) -> list[str]:
    """The page's tables: tokens/s per model, the `ratios` ((row name, result key)) and the training state; with
    `noise_warning`, a line where the per-round ratios spread by more than a factor of 1.5."""
    mib = 2**20

    def ratio_row(name: str, key: str) -> str:
        x = r[key]
        return f"| {name} | {x['median']:.3f} | {x['min']:.3f} – {x['max']:.3f} | {x['target']} |"

    noisy = noise_warning and any(r[key]["max"] > 1.5 * r[key]["min"] for _, key in ratios)
    return [
        "",
        "| model | median tokens/s |",
        "|---|---:|",
        *(f"| {name} | {value:,.0f} |" for name, value in r["tokens_per_s_median"].items()),
        "",
        "| ratio (per round, same process) | median | min – max | target |",
        "|---|---:|---:|---|",
        *(ratio_row(name, key) for name, key in ratios),
        "",
        *(
            [
                "The per-round ratios spread by more than a factor of 1.5 (timing noise, e.g. other jobs on the "
                "machine): these throughput numbers settle neither target. Rerun on an idle machine or a GPU.",
                "",
            ]
            if noisy
            else []
        ),
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


def render_markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        "# Training throughput: P2R vs Llama, pseudo vs real",
        "",
        produced_by(r, "scripts/bench_throughput.py"),
        *(
            ["CPU numbers: GPU throughput (`--device cuda`, bf16, a ~0.5B model) is pending a run on a GPU."]
            if c["device"] == "cpu"
            else []
        ),
        machine_line(r["machine"]),
        f"Model: hidden {c['hidden_size']}, FFN {c['intermediate_size']}, {c['num_attention_heads']} heads "
        f"({c['num_key_value_heads']} KV), {c['num_hidden_layers']} layers, vocab {c['vocab_size']}; batch "
        f"{c['batch']} x {c['seq']} tokens; {c['dtype']}; attention `{c['attn_implementation']}`; pseudo model "
        f"k = {c['pseudo_num_unique_layers']}. {c['rounds']} interleaved rounds of {c['steps_per_round']} training "
        "steps (forward + backward + AdamW) per model.",
        *tables(r, [("P2R real / Llama", "ratio_real_vs_llama"), ("P2R pseudo / P2R real", "ratio_pseudo_vs_real")]),
    ]
    return "\n".join(lines)
