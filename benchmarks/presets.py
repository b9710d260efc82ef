"""Model sizes and trainer runs the benchmarks share. Each benchmark's own presets pair one of these with its batch and
run lengths."""


def model(
    *, hidden: int, ffn: int, heads: int, layers: int, kv_heads: int | None = None, vocab: int | None = None
) -> dict:
    """A Llama-shaped model's size, as the fields `P2RConfig`, `LlamaConfig` and the trainer take; `kv_heads` and
    `vocab` left out where None (the trainer's defaults: the query heads, the tokenizer's size rounded up to 64)."""
    fields = dict(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
    )
    return {name: value for name, value in fields.items() if value is not None}


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


def data(*, block: int, batch: int, corpus: int) -> dict:
    """A trainer run's data, as its flags: sequences of `block` tokens, `batch` of them a step on each process, from
    the first `corpus` bytes of the corpus."""
    return dict(block_size=block, per_device_batch_size=batch, corpus_max_bytes=corpus)


def schedule(*, lr: float | None = None, warmup: int, log_every: int, eval_every: int, eval_blocks: int) -> dict:
    """A trainer run's schedule, as its flags: the peak learning rate (None: the trainer's default), its warm-up steps,
    a log record every `log_every` steps, a validation loss on `eval_blocks` blocks every `eval_every` steps."""
    fields = dict(warmup_steps=warmup, logging_steps=log_every, eval_steps=eval_every, eval_blocks=eval_blocks)
    return fields if lr is None else {"learning_rate": lr, **fields}


# The trainer's flags (`hf-p2r train`) for the model and data of a run; each benchmark adds its schedule.
# Seconds on CPU: checks a script that trains, end to end (a dry or smoke run), not a result.
TINY_RUN = {**model(hidden=32, ffn=64, heads=2, layers=4), **data(block=32, batch=4, corpus=30000), "cpu": "true"}
# Minutes a run on 2 CPU cores: the CPU studies' model and data (benchmarks/convergence.md, offload_delayed.md).
CPU_RUN = {**model(hidden=96, ffn=256, heads=4, layers=8), **data(block=128, batch=8, corpus=2_000_000)}
