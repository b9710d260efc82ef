"""MoE training throughput and training-state bytes: P2R MoE (real) vs transformers' Mixtral, and pseudo vs real.

`scripts/bench_throughput.py`'s method (`benchmarks.throughput.measure`): the three models have identical dimensions,
attention and experts implementation and run in ONE process, interleaved round by round; the ratios are medians over
rounds of per-round ratios.

    python scripts/bench_moe_throughput.py                      # CPU preset, writes benchmarks/moe_throughput.{json,md}
    python scripts/bench_moe_throughput.py --device cuda        # GPU preset (bf16 autocast)
    python scripts/bench_moe_throughput.py --preset tiny --rounds 1 --warmup 0 --out /tmp/t   # smoke run (seconds)
"""

from transformers import MixtralForCausalLM

from benchmarks import presets
from benchmarks.harness import Runner
from benchmarks.throughput import command_line, machine_line, measure, prepare, produced_by, tables, write
from hf_p2r import P2RMoeConfig, P2RMoeForCausalLM, mixtral_config

PRESETS = {
    "tiny": dict(presets.moe(presets.TINY, experts=4), batch=2, seq=16),
    # 2 CPU cores: 8 experts of half the dense preset's FFN, top-2 (a token's FFN compute is the dense preset's).
    "cpu": dict(presets.moe(presets.CPU, experts=8), batch=4, seq=256),
    # For one H100/H200: 8 experts of width 1408.
    "cuda": dict(
        presets.moe(presets.model(hidden=1024, ffn=2816, heads=16, kv_heads=4, layers=16, vocab=32000), experts=8),
        batch=8,
        seq=2048,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, PRESETS, "benchmarks/moe_throughput", rounds=10, steps=2, warmup=1)
    parser.add_argument("--experts", default="grouped_mm", help="experts implementation for all models")
    args = parser.parse_args(argv)
    prepared = prepare(args, PRESETS, "bench_moe_throughput")
    if prepared is None:
        return 1
    fields, batch, autocast_dtype = prepared
    dims = dict(fields, intermediate_size=fields["moe_intermediate_size"], max_position_embeddings=batch.shape[1])
    dims.update(num_experts_per_tok=2, tie_word_embeddings=False)
    real_config = P2RMoeConfig(**dims)
    pseudo_config = P2RMoeConfig(**dims, share_layers=True, num_unique_layers=args.num_unique_layers)
    runners = [
        Runner("mixtral", MixtralForCausalLM(mixtral_config(real_config)), batch, args.device, autocast_dtype),
        Runner("p2r_moe_real", P2RMoeForCausalLM(real_config), batch, args.device, autocast_dtype),
        Runner("p2r_moe_pseudo", P2RMoeForCausalLM(pseudo_config), batch, args.device, autocast_dtype),
    ]
    for runner in runners:
        runner.model.set_experts_implementation(args.experts)
    result = measure(runners, args, dims, experts_implementation=args.experts)
    write(args.out, result, render_markdown(result))
    return 0


def render_markdown(r: dict) -> str:
    c = r["config"]
    ratios = [
        ("P2R MoE real / Mixtral", "ratio_real_vs_mixtral"),
        ("P2R MoE pseudo / P2R MoE real", "ratio_pseudo_vs_real"),
    ]
    lines = [
        "# MoE training throughput: P2R MoE vs Mixtral, pseudo vs real",
        "",
        produced_by(r, "scripts/bench_moe_throughput.py"),
        machine_line(r["machine"]),
        f"Model: hidden {c['hidden_size']}, {c['num_experts']} experts of FFN {c['moe_intermediate_size']} (top-"
        f"{c['num_experts_per_tok']}) in every layer, {c['num_attention_heads']} heads ({c['num_key_value_heads']} "
        f"KV), {c['num_hidden_layers']} layers, vocab {c['vocab_size']}; batch {c['batch']} x {c['seq']} tokens; "
        f"{c['dtype']}; attention `{c['attn_implementation']}`, experts `{c['experts_implementation']}`; pseudo model "
        f"k = {c['pseudo_num_unique_layers']}. {c['rounds']} interleaved rounds of {c['steps_per_round']} training "
        "steps (forward + backward + AdamW) per model; no aux loss (Mixtral's default, `output_router_logits=False`).",
        *tables(r, ratios, noise_warning=True),
    ]
    return "\n".join(lines)
