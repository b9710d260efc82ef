"""MoE training throughput and training-state bytes: P2R MoE (real) vs transformers' Mixtral, and pseudo vs real.

`scripts/bench_throughput.py`'s method (its `Runner`, `machine`, `training_state_bytes`): the three models have
identical dimensions, attention and experts implementation and run in ONE process, interleaved round by round; the
ratios are medians over rounds of per-round ratios.

    python scripts/bench_moe_throughput.py                      # CPU preset, writes benchmarks/moe_throughput.{json,md}
    python scripts/bench_moe_throughput.py --device cuda        # GPU preset (bf16 autocast)
    python scripts/bench_moe_throughput.py --preset tiny --rounds 1 --warmup 0 --out /tmp/t   # smoke run (seconds)
"""

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import MixtralForCausalLM

from hf_p2r import P2RMoeConfig, P2RMoeForCausalLM, mixtral_config

_spec = importlib.util.spec_from_file_location("bench_throughput", Path(__file__).with_name("bench_throughput.py"))
bench_throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_throughput)

PRESETS = {
    "tiny": dict(
        hidden_size=32,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=128,
        num_experts=4,
        batch=2,
        seq=16,
    ),
    # 2 CPU cores: 8 experts of half the dense preset's FFN, top-2 (a token's FFN compute is the dense preset's).
    "cpu": dict(
        hidden_size=256,
        moe_intermediate_size=352,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=8,
        vocab_size=8192,
        num_experts=8,
        batch=4,
        seq=256,
    ),
    "cuda": dict(
        hidden_size=1024,
        moe_intermediate_size=1408,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=16,
        vocab_size=32000,
        num_experts=8,
        batch=8,
        seq=2048,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model and batch sizes (default: the device's)")
    parser.add_argument("--attn", default="sdpa", help="attention implementation for all models")
    parser.add_argument("--experts", default="grouped_mm", help="experts implementation for all models")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="training steps per model per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    parser.add_argument("--num-unique-layers", type=int, default=1, help="k of the pseudo model")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/moe_throughput"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_moe_throughput: --device cuda needs a CUDA device; none is available", file=sys.stderr)
        return 1

    preset = dict(PRESETS[args.preset or args.device])
    batch_size, seq = preset.pop("batch"), preset.pop("seq")
    dims = dict(preset, intermediate_size=preset["moe_intermediate_size"], max_position_embeddings=seq)
    dims.update(num_experts_per_tok=2, tie_word_embeddings=False)
    autocast_dtype = torch.bfloat16 if args.device == "cuda" else None
    torch.manual_seed(0)
    batch = torch.randint(0, dims["vocab_size"], (batch_size, seq), device=args.device)

    real_config = P2RMoeConfig(**dims)
    pseudo_config = P2RMoeConfig(**dims, share_layers=True, num_unique_layers=args.num_unique_layers)
    Runner = bench_throughput.Runner
    runners = [
        Runner("mixtral", MixtralForCausalLM(mixtral_config(real_config)), batch, args.device, autocast_dtype),
        Runner("p2r_moe_real", P2RMoeForCausalLM(real_config), batch, args.device, autocast_dtype),
        Runner("p2r_moe_pseudo", P2RMoeForCausalLM(pseudo_config), batch, args.device, autocast_dtype),
    ]
    for runner in runners:
        runner.model.set_attn_implementation(args.attn)
        runner.model.set_experts_implementation(args.experts)
    by_name = bench_throughput.interleave(runners, args.rounds, args.steps, args.warmup)

    state = {name: bench_throughput.training_state_bytes(r.model, r.optimizer) for name, r in by_name.items()}
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": bench_throughput.machine(),
        "config": {
            **dims,
            "batch": batch_size,
            "seq": seq,
            "attn_implementation": args.attn,
            "experts_implementation": args.experts,
            "dtype": "bf16 autocast" if autocast_dtype else "fp32",
            "device": args.device,
            "preset": args.preset or args.device,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "pseudo_num_unique_layers": args.num_unique_layers,
        },
        "tokens_per_s_median": {name: statistics.median(r.tokens_per_s) for name, r in by_name.items()},
        "tokens_per_s": {name: r.tokens_per_s for name, r in by_name.items()},
        "ratio_real_vs_mixtral": bench_throughput.ratio_summary(by_name, "p2r_moe_real", "mixtral", ">= 1.00"),
        "ratio_pseudo_vs_real": bench_throughput.ratio_summary(by_name, "p2r_moe_pseudo", "p2r_moe_real", ">= 0.98"),
        "training_state_bytes": state,
        "state_ratio_pseudo_vs_real": {
            "measured": state["p2r_moe_pseudo"]["total"] / state["p2r_moe_real"]["total"],
            "expected": bench_throughput.expected_state_ratio(by_name["p2r_moe_real"].model, args.num_unique_layers),
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
    preset = f" --preset {c['preset']}" if c["preset"] != c["device"] else ""

    def ratio_row(name: str, key: str) -> str:
        x = r[key]
        return f"| {name} | {x['median']:.3f} | {x['min']:.3f} – {x['max']:.3f} | {x['target']} |"

    lines = [
        "# MoE training throughput: P2R MoE vs Mixtral, pseudo vs real",
        "",
        f"Produced by `scripts/bench_moe_throughput.py --device {c['device']}{preset}` on {r['date']}.",
        f"Machine: {m.get('gpu', m['cpu'])}; {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"{m['platform']}.",
        f"Model: hidden {c['hidden_size']}, {c['num_experts']} experts of FFN {c['moe_intermediate_size']} (top-"
        f"{c['num_experts_per_tok']}) in every layer, {c['num_attention_heads']} heads ({c['num_key_value_heads']} "
        f"KV), {c['num_hidden_layers']} layers, vocab {c['vocab_size']}; batch {c['batch']} x {c['seq']} tokens; "
        f"{c['dtype']}; attention `{c['attn_implementation']}`, experts `{c['experts_implementation']}`; pseudo model "
        f"k = {c['pseudo_num_unique_layers']}. {c['rounds']} interleaved rounds of {c['steps_per_round']} training "
        "steps (forward + backward + AdamW) per model; no aux loss (Mixtral's default, `output_router_logits=False`).",
        "",
        "| model | median tokens/s |",
        "|---|---:|",
        *(f"| {name} | {value:,.0f} |" for name, value in r["tokens_per_s_median"].items()),
        "",
        "| ratio (per round, same process) | median | min – max | target |",
        "|---|---:|---:|---|",
        ratio_row("P2R MoE real / Mixtral", "ratio_real_vs_mixtral"),
        ratio_row("P2R MoE pseudo / P2R MoE real", "ratio_pseudo_vs_real"),
        "",
        *(
            [
                "The per-round ratios spread by more than a factor of 1.5 (timing noise, e.g. other jobs on the "
                "machine): these throughput numbers settle neither target. Rerun on an idle machine or a GPU.",
                "",
            ]
            if any(r[key]["max"] > 1.5 * r[key]["min"] for key in ("ratio_real_vs_mixtral", "ratio_pseudo_vs_real"))
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
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
