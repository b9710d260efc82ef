"""Model sizes the benchmarks share. Each benchmark's own presets pair one of these with its batch and run lengths."""


def model(*, hidden: int, ffn: int, heads: int, kv_heads: int, layers: int, vocab: int) -> dict:
    """A Llama-shaped model's size, as the fields `P2RConfig` and `LlamaConfig` take."""
    return dict(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
    )


def moe(dense: dict, *, experts: int) -> dict:
    """`dense` with every FFN sparse: `experts` experts of half its width in its place (top-2 routing then costs a
    token the dense model's FFN compute), as the fields `P2RMoeConfig` takes."""
    fields = {("moe_intermediate_size" if key == "intermediate_size" else key): value for key, value in dense.items()}
    return {**fields, "moe_intermediate_size": dense["intermediate_size"] // 2, "num_experts": experts}


# Seconds in all: for checking a script end to end (its tests), not for measuring.
TINY = model(hidden=32, ffn=64, heads=4, kv_heads=2, layers=4, vocab=128)
# Small enough for 2 CPU cores, large enough that a step is matmul-bound (tens of ms).
CPU = model(hidden=256, ffn=704, heads=8, kv_heads=4, layers=8, vocab=8192)
# A ~0.5B real model (25M parameters per layer), for one H100/H200.
GPU = model(hidden=1536, ffn=4096, heads=12, kv_heads=4, layers=16, vocab=32000)
