"""The trainer's fields, in sections: what each part of the trainer reads, and nothing else.

| section (`TrainConfig.`) | class | what |
|---|---|---|
| `model` | `ModelArguments` | the model: Llama's fields, `model_config`, k, the MoE fields |
| `data` | `DataArguments` | the corpus, the tokenizer, the blocks |
| `stages` | `StageArguments` | pseudo and real steps, the partial delinks, the optimizer state's carry |
| `optim` | `OptimizerArguments` | AdamW / Muon and their hyperparameters, clipping, the shared blocks' rate |
| `schedule` | `ScheduleArguments` | the learning-rate schedule |
| `offload` | `OffloadArguments` | granular CPU offload |
| `parallel` | `ParallelArguments` | pipeline stages, data-parallel pipelines, FSDP2 of the stages |
| `compute` | `ComputeArguments` | batch, seed, device, precision, compile, loss kernel |
| `checkpointing` | `CheckpointArguments` | output folder, checkpoints, resume |
| `logging` | `LoggingArguments` | metrics, evaluation, trackers |

The YAML file and the command line stay flat (a field's name is its key and its `--flag`, whatever its section); every
field is declared once, here, with `option(default, help, check=..., resume=...)` (`hf_p2r.config.fields`). To add a
field: one line in its section; a rule comparing it with other fields: one function in `hf_p2r.config.rules`.
`TrainArguments` is the sections but the model's and the data's as one flat object, for code written before them.

Plain Python (no torch, no transformers).
"""

from dataclasses import dataclass
from typing import Any, Literal

import yaml

from ..distributed.pipeline.schedules import SCHEDULES
from .fields import ConfigError, above, at_least, between, option, section, short

__all__ = [
    "MOE_FIELDS",
    "SECTIONS",
    "CheckpointArguments",
    "ComputeArguments",
    "DataArguments",
    "LearningRateSchedule",
    "LoggingArguments",
    "ModelArguments",
    "OffloadArguments",
    "OptimizerArguments",
    "ParallelArguments",
    "ScheduleArguments",
    "StageArguments",
    "even_delink_steps",
    "offload_text",
    "parse_offload",
]

# ModelArguments fields passed to P2RMoeConfig when num_experts > 0.
MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "num_expert_groups",
    "router_aux_loss_coef",
)


def offload_text(value: Any) -> Any:
    """`offload` in its canonical string form: YAML gives a number (0.5) or a list ([1, 3, 5]), the command line a
    string; "none" is None (no offload, as leaving it out); anything else is returned as it is (for the checks to
    name)."""
    if isinstance(value, str) and value.strip() in ("", "none"):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | list):
        return value
    if isinstance(value, list) and not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    return str(value)


def parse_offload(text: str | None) -> str | float | list[int] | None:
    """ "auto" | "0.5" | "[1, 3, 5]" | None -> "auto" | 0.5 | [1, 3, 5] | None; `ValueError` naming what it takes
    else."""
    text = None if text is None else text.strip()
    if text in (None, "", "none"):
        return None
    if text == "auto":
        return text
    try:
        if text.startswith("["):
            indices = yaml.safe_load(text)
            if isinstance(indices, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
                return indices
        elif 0.0 <= (ratio := float(text)) <= 1.0:
            return ratio
    except (ValueError, yaml.YAMLError, RecursionError):
        pass
    raise ValueError(
        f"expected auto, a ratio between 0 and 1 (0.5) or a list of block indices ([1, 3, 5]), got {short(text)}"
    )


def check_offload(value: str | None) -> None:
    if isinstance(value, str):
        parse_offload(value)


def rope_type_given(value: dict | None) -> None:
    if value is not None and not isinstance(value.get("rope_type"), str):
        raise ValueError(f"needs a rope_type (linear, dynamic, yarn, llama3, ...), got {short(value)}")


@section
@dataclass
class ModelArguments:
    """The model: Llama's fields (or a Llama / P2R config.json, `model_config`) and the pseudo model's k. The run
    starts from a pseudo model with `num_unique_layers` blocks (unless `pseudo_steps` is 0: then it trains the real
    model from scratch)."""

    model_config: str | None = option(
        None,
        "A Llama or P2R config.json (a file, a model folder, or a Hub model id already in the local cache: read "
        "offline) whose fields are the model fields' values; the YAML file and the flags override them.",
    )
    hidden_size: int = option(128, "Width of the residual stream.", check=at_least(1), resume="fixed")
    intermediate_size: int = option(512, "Width of the SwiGLU MLP.", check=at_least(1), resume="fixed")
    num_hidden_layers: int = option(
        8,
        "Depth L of the real model (and of the pseudo model, unless pseudo_num_hidden_layers makes it shallower).",
        check=at_least(1),
        resume="fixed",
    )
    num_attention_heads: int = option(4, "Query heads.", check=at_least(1), resume="fixed")
    num_key_value_heads: int | None = option(
        None,
        "KV heads (default: query heads).",
        check=at_least(1),
        resume="fixed",
    )
    head_dim: int | None = option(
        None,
        "Width of a head (default: hidden_size / heads).",
        check=at_least(1),
        resume="fixed",
    )
    num_unique_layers: int = option(
        1,
        "k, the distinct blocks of the pseudo model (unused when pseudo_steps is 0).",
        check=at_least(1),
        resume="fixed",
    )
    sharing_pattern: Literal["cycle", "sequence"] = option(
        "cycle",
        "cycle: depth i runs block i mod k; sequence: block floor(i*k/L).",
        resume="fixed",
    )
    vocab_size: int | None = option(
        None,
        "Embedding rows (default: the tokenizer's size rounded up to 64).",
        check=at_least(1),
        resume="fixed",
    )
    max_position_embeddings: int | None = option(
        None,
        "Longest sequence the model is declared for, kept in its saves (default: block_size).",
        check=at_least(1),
        resume="fixed",
    )
    tie_word_embeddings: bool = option(False, "Share the input and output embeddings.", resume="fixed")
    initializer_range: float = option(0.02, "Std of the initial weights.", check=above(0.0), resume="fixed")
    rms_norm_eps: float = option(1e-6, "Epsilon of the RMS norms.", check=above(0.0), resume="fixed")
    hidden_act: str = option("silu", "The MLP's activation (transformers' ACT2FN names).", resume="fixed")
    rope_theta: float = option(10000.0, "RoPE base.", check=above(0.0), resume="fixed")
    rope_scaling: dict[str, Any] | None = option(
        None,
        "RoPE scaling beyond rope_theta, as transformers' rope_parameters take it: rope_type and its fields, e.g."
        " {rope_type: linear, factor: 2.0} (YAML; a flag takes the same text).",
        check=rope_type_given,
        resume="fixed",
    )
    attention_bias: bool = option(False, "Biases in the attention projections.", resume="fixed")
    attention_dropout: float = option(
        0.0,
        "Dropout of the attention weights in training.",
        check=between(0.0, 1.0, strict_high=True),
        resume="fixed",
    )
    mlp_bias: bool = option(False, "Biases in the MLP projections.", resume="fixed")
    depth_mup: bool = option(
        False,
        "Depth-muP (arXiv 2310.02244): each residual branch's output times 1/sqrt(num_hidden_layers), and the blocks' "
        "learning rate too (the model's block_lr_scale; hf_p2r.training.optim.shared_lr_scales).",
        resume="fixed",
    )
    attn_implementation: str = option("sdpa", "Attention kernel: sdpa, eager, flash_attention_2, ...", resume="fixed")
    activation_checkpointing: bool = option(
        False,
        "Recompute activations in the backward pass to save memory.",
        resume="fixed",
    )
    num_experts: int = option(0, "Experts per sparse layer; 0: a dense model.", resume="fixed")
    num_experts_per_tok: int = option(2, "Experts per token (top-k).", resume="fixed")
    moe_intermediate_size: int | None = option(
        None,
        "Width of each expert (default: intermediate_size).",
        resume="fixed",
    )
    decoder_sparse_step: int = option(1, "Depth d is sparse when d + 1 is a multiple.", resume="fixed")
    mlp_only_layers: list[int] = option([], "Depths that stay dense.", resume="fixed")
    norm_topk_prob: bool = option(True, "Renormalise the top-k routing weights.", resume="fixed")
    num_expert_groups: int = option(1, "M6-T expert prototyping: top-1 in each of this many groups.", resume="fixed")
    router_aux_loss_coef: float = option(0.001, "Weight of the load-balancing loss.", resume="fixed")


@section
@dataclass
class DataArguments:
    """Where the text comes from and how it is cut into training blocks. With no `dataset_name` and no
    `train_files`, the corpus is a deterministic subset of the Python standard library's sources (no download)."""

    dataset_name: str | None = option(
        None,
        "A Hub dataset to download (only when set), e.g. Salesforce/wikitext.",
        resume="fixed",
    )
    dataset_config_name: str | None = option(None, "The Hub dataset's configuration.", resume="fixed")
    train_files: list[str] = option(
        [],
        "Local .txt/.md/.rst/.py (split into documents: text_document_separator), .json/.jsonl or .parquet files (a"
        " record is a document), or folders of them.",
        resume="fixed",
    )
    text_column: str = option("text", "Column holding the text (JSON, Parquet and Hub datasets).", resume="fixed")
    text_document_separator: str | None = option(
        None,
        "Where a text file (.txt/.md/.py/.rst) splits into documents: a string (escapes \\n \\t \\f read as such,"
        " e.g. '\\n\\n\\n' or '<|endoftext|>'), or '' for one document per file. Default: at blank lines (a line of"
        " whitespace only) in .txt/.md/.rst files; each .py file is one document.",
        resume="fixed",
    )
    allow_data_change: bool = option(
        False,
        "Resume on training data that differs from the checkpoint's (files added, removed or modified) with a "
        "one-line warning, instead of refusing: its data position then points into other data.",
    )
    streaming: bool = option(
        False,
        "Stream dataset_name or train_files (.jsonl/.parquet/text shards): read, split per process, tokenized and"
        " packed on the fly, resumed exactly from the position each checkpoint keeps.",
        resume="fixed",
    )
    validation_files: list[str] = option(
        [],
        "A streaming run's held-out files (default: the Hub dataset's validation split); each evaluation reads "
        "their first eval_blocks blocks.",
        resume="fixed",
    )
    corpus_max_bytes: int = option(
        2_000_000,
        "Size of the built-in standard-library corpus, in bytes.",
        check=at_least(1),
        resume="fixed",
    )
    tokenizer_name: str | None = option(
        None,
        "Tokenizer folder or Hub name (default: the built-in byte-level tokenizer).",
        resume="fixed",
    )
    block_size: int = option(
        128,
        "Tokens per training sequence (documents are packed).",
        check=at_least(2),
        resume="fixed",
    )
    validation_fraction: float = option(
        0.05,
        "Share of the text held out for validation, by whole documents (map-style runs).",
        check=between(0.0, 1.0, strict_low=True, strict_high=True),
        resume="fixed",
    )
    preprocessing_num_workers: int | None = option(None, "Processes for tokenization.", check=at_least(1))
    cache_dir: str | None = option(None, "datasets cache folder (default: HF's).")


@section
@dataclass
class StageArguments:
    """The stages: `pseudo_steps` on the pseudo model, its partial delinks, the delink to the real model, `real_steps`
    on it; what the optimizer state of delinked blocks becomes."""

    pseudo_steps: int = option(
        100,
        "Optimizer steps before delinking to the real model (0: train it from scratch).",
        check=at_least(0),
    )
    real_steps: int = option(100, "Optimizer steps on the real model.", check=at_least(0))
    partial_delink_steps: list[int] = option(
        [],
        "Step of each partial delink, increasing, in (0, pseudo_steps). Default: evenly spaced over the pseudo "
        "stage (the i-th of n at round(pseudo_steps * i / (n + 1))), so they follow --pseudo_steps.",
    )
    partial_delink_blocks: list[int] = option(
        [],
        "Blocks after each partial delink in the pseudo stage, e.g. 2 4 (1 -> 2 -> 4 -> L); unused when "
        "pseudo_steps is 0.",
    )
    pseudo_num_hidden_layers: int | None = option(
        None,
        "Depth d of the pseudo stage, 1 <= d <= L (default L: a full-depth pseudo model). d < L trains a shallow "
        "model (num_unique_layers blocks, at most d) that grows to L at a delink (growth).",
        check=at_least(1),
        resume="fixed",
    )
    partial_delink_depths: list[int] = option(
        [],
        "Depth after each partial delink, one per partial_delink_blocks entry, never decreasing, at most L (default: "
        "the depth does not change); a deeper one grows the model (growth).",
    )
    growth: Literal["stack", "interleave"] = option(
        "stack",
        "How a delink that grows the depth d -> d' maps the new layers: stack (layer i copies i mod d, G_stack) or "
        "interleave (layer i copies floor(i*d/d')).",
    )
    function_preserving: bool = option(
        False,
        "A growth's new layers start with zero output projections (o_proj, down_proj): the grown model computes the "
        "shallow one's function (and loss).",
    )
    optimizer_carry: Literal["reset", "copy", "scale"] = option(
        "scale",
        "Adam state of the delinked layers: reset (fresh), copy (the shared moments), or scale (moments times "
        "n'/n, squared moments times (n'/n)^2, n = depths a block served before, n' after).",
    )

    @property
    def total_steps(self) -> int:
        return self.pseudo_steps + self.real_steps


@section
@dataclass
class OptimizerArguments:
    """The optimizer: AdamW, or Muon for the blocks' matrices; its hyperparameters and the clipping."""

    optimizer: Literal["adamw", "muon"] = option(
        "adamw",
        "adamw, or muon: torch.optim.Muon for the blocks' matrices (an MoE model's experts one expert at a time),"
        " AdamW for the embeddings, norms, head and biases (hf_p2r.training.optim.MuonAdamW).",
        resume="fixed",
    )
    learning_rate: float = option(1e-3, "Peak AdamW learning rate.", check=above(0.0))
    weight_decay: float = option(0.1, "AdamW weight decay (matrices and embeddings only).", check=at_least(0.0))
    adam_beta1: float = option(0.9, "AdamW beta1.", check=between(0.0, 1.0, strict_high=True))
    adam_beta2: float = option(0.95, "AdamW beta2.", check=between(0.0, 1.0, strict_high=True))
    adam_epsilon: float = option(1e-8, "AdamW epsilon.", check=above(0.0))
    muon_learning_rate: float | None = option(
        None,
        "Peak Muon learning rate, on the same schedule (default: learning_rate; with match_rms_adamw, Muon takes "
        "AdamW's rate and weight decay, arXiv 2502.16982).",
        check=above(0.0),
    )
    muon_momentum: float = option(
        0.95,
        "Muon momentum (torch.optim.Muon's default).",
        check=between(0.0, 1.0, strict_high=True),
    )
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = option(
        "match_rms_adamw",
        "torch.optim.Muon's learning-rate adjustment per matrix shape: match_rms_adamw (0.2 sqrt(max(A, B)): "
        "updates of AdamW's RMS, Moonshot's) or original (sqrt(max(1, A/B)), Keller Jordan's).",
    )
    max_grad_norm: float = option(1.0, "Gradient clipping (0: off).", check=at_least(0.0))
    shared_lr_scale: Literal["none", "depth"] = option(
        "depth",
        "Learning rate of a shared block: depth (divided by the number of depths the block runs at, so its update"
        " moves the function as much as an unshared block's; logged as lr_shared, the most shared block's; see "
        "benchmarks/convergence_carry.md) or none (the same as every parameter).",
        resume="fixed",
    )


@section
@dataclass
class ScheduleArguments:
    """The learning-rate schedule: warm-up, decay over `lr_schedule_steps` (the run by default), what a delink does
    to it."""

    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = option(
        "cosine",
        "Decay over the schedule's steps (lr_schedule_steps), after warmup_steps; wsd: warmup-stable-decay, the "
        "peak rate until the last lr_decay_fraction of the schedule, then a 1-sqrt decay to the floor.",
    )
    warmup_steps: int = option(
        20,
        "Linear warm-up at the start of the run (at most lr_schedule_steps).",
        check=at_least(0),
    )
    lr_schedule_steps: int | None = option(
        None,
        "Steps the learning-rate schedule spans, its last at min_lr_ratio (default: pseudo_steps + real_steps). A"
        " resume that changes the run's length keeps the saved schedule's (steps past its end run at the final "
        "rate) unless this is given.",
        check=at_least(1),
    )
    min_lr_ratio: float = option(0.1, "Final learning rate / peak (cosine, linear, wsd).", check=between(0.0, 1.0))
    lr_decay_fraction: float = option(
        0.2,
        "wsd: the fraction of the run (all steps) spent decaying, in (0, 1].",
        check=between(0.0, 1.0, strict_low=True),
    )
    lr_after_delink: Literal["continue", "rewarm"] = option(
        "continue",
        "continue the schedule, or rewarm it over rewarm_steps after delinking.",
    )
    rewarm_steps: int = option(20, "Length of the warm-up after a delink (rewarm).", check=at_least(1))


@section
@dataclass
class OffloadArguments:
    """Granular CPU offload of blocks (one process): which blocks, the device memory it plans for, how the offloaded
    blocks' optimizer steps."""

    offload: str | None = option(
        None,
        "Granular CPU offload of blocks (one process): auto, a ratio of blocks (0.5) or block indices ([1, 3, 5]:"
        " blocks of the first model, which a pseudo model with k blocks numbers 0..k-1); re-selected after every "
        "delink, so auto offloads nothing while the pseudo model fits.",
        check=check_offload,
        convert=offload_text,
    )
    offload_budget_gb: float | None = option(
        None,
        "Device memory offload: auto plans for (default on CUDA: 85%% of it; needed on a CPU run).",
        check=above(0.0),
    )
    offload_prefetch: int = option(1, "Offloaded blocks copied ahead of their use.", check=at_least(0))
    offload_optimizer: Literal["host", "device_chunked"] = option(
        "host",
        "Where the offloaded blocks' optimizer step runs: host (the CPU, over CPU state) or device_chunked (the "
        "compute device, offload_chunk_mb at a time, the state kept in pinned host memory: Megatron-Core's "
        "chunked optimizer-state offload).",
    )
    offload_chunk_mb: float = option(
        256.0,
        "device_chunked: MiB of parameters, gradients and optimizer state stepped at a time.",
        check=above(0.0),
    )
    offload_grad_accumulation: Literal["host", "device"] = option(
        "host",
        "Where an offloaded block's gradient is summed over a step's micro-batches: host (each micro-batch's gradient "
        "sent and added on the CPU; no device memory) or device (summed on the device in a buffer per offloaded "
        "parameter, offload_grad_dtype bytes each, and sent once per step).",
    )
    offload_grad_dtype: Literal["fp32", "bf16"] = option(
        "fp32", "offload_grad_accumulation device: dtype of the sums and of their copy to the host."
    )
    offload_update: Literal["after_backward", "during_backward", "delayed"] = option(
        "after_backward",
        "When the host updates offloaded blocks (offload_optimizer host): after_backward (each block while the next "
        "forward runs, before its use), during_backward (each block once its last gradient has landed; needs "
        "max_grad_norm 0) or delayed (during the next step, which sends the weights of the update before: one step "
        "stale, as ZeRO-Offload's delayed parameter update; not exact).",
    )
    offload_delay_correction: Literal["none", "error_feedback"] = option(
        "none", "offload_update delayed: correct the stale update (PipeDream-2BW's error feedback)."
    )
    offload_host_threads: int = option(
        1, "Host threads updating offloaded blocks (and summing their gradients).", check=at_least(1)
    )

    @property
    def offload_spec(self) -> str | float | list[int] | None:
        """`offload` as `GranularOffload` takes it: "auto", a ratio, a list of block indices, or None."""
        return parse_offload(self.offload)

    def check_offload_budget(self, device_type: str) -> None:
        """`offload: auto` plans for a device's memory: refuse it without `offload_budget_gb` where the run computes on
        a device whose memory is not known (anything but CUDA). Checked while parsing for `cpu: true`, and by the
        trainer once the device is known."""
        if self.offload == "auto" and self.offload_budget_gb is None and device_type != "cuda":
            raise ConfigError(
                f"offload: auto plans for a device's memory, and this run computes on {device_type}: set "
                "offload_budget_gb (the memory the resident part may use), or give a ratio or block indices"
            )


@section
@dataclass
class ParallelArguments:
    """Parallelism the trainer applies itself: pipeline stages, their schedule and split, data-parallel pipelines (or
    the whole model one stage, FSDP2-sharded or replicated). (One process, DDP, FSDP2 and DeepSpeed under `accelerate
    launch` are the launcher's config.)"""

    pipeline_parallel_size: int = option(
        1,
        "Pipeline stages (processes) the model is split into by depth (hf_p2r.distributed).",
        check=at_least(1),
    )
    pipeline_schedule: Literal[SCHEDULES] = option(
        "1f1b",
        "Pipeline schedule: torch's gpipe, 1f1b, interleaved_1f1b, zero_bubble, or PipeDream-2BW.",
    )
    pipeline_delay_correction: Literal["none", "error_feedback"] = option(
        "none",
        "2bw: error_feedback adds to each delayed update the error of the one before it (the update computed one "
        "step later minus the update applied; hf_p2r.distributed.pipeline.pipedream), for either optimizer; none:"
        " the plain delayed update.",
    )
    num_microbatches: int | None = option(
        None,
        "Micro-batches per optimizer step in a pipeline (default: pipeline_parallel_size).",
        check=at_least(1),
    )
    pipeline_split: list[int] | None = option(
        None,
        "Layers per stage, e.g. 3 5 (YAML: [3, 5]; default: balanced from FLOPs and bytes).",
    )
    data_parallel_size: int = option(
        1,
        "Data-parallel pipelines beside pipeline_parallel_size (a 2-D mesh of data_parallel_size x "
        "pipeline_parallel_size processes); each reads per_device_batch_size blocks per step. With "
        "pipeline_parallel_size 1 the whole model is one stage on each of the data_parallel_size processes "
        "(torchrun; on CPU too): FSDP2-sharded with data_parallel_shard, else replicated, gradients averaged as "
        "DDP does; num_microbatches is then gradient accumulation (gpipe or 1f1b).",
        check=at_least(1),
    )
    data_parallel_shard: bool = option(
        False,
        "Shard each pipeline stage with FSDP2 over the data-parallel pipelines (weights, gradients and optimizer "
        "state split data_parallel_size ways; with pipeline_parallel_size 1, the whole model: FSDP2 applied by "
        "the trainer itself); default: replicated stages that average gradients.",
    )


@section
@dataclass
class ComputeArguments:
    """How each step computes: the batch, the seed, the device, precision, compilation and the loss kernel."""

    seed: int = option(0, "Seeds the initial weights, the data split and the data order.", resume="fixed")
    per_device_batch_size: int = option(16, "Blocks per micro-batch per process.", check=at_least(1))
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", check=at_least(1))
    cpu: bool | None = option(None, "Train on CPU (gloo for several processes). Default: when no accelerator.")
    mixed_precision: Literal["no", "fp16", "bf16"] | None = option(
        None,
        "Default: what `accelerate config` / `accelerate launch` says.",
    )
    compile: bool = option(
        False,
        "Compile each decoder block with torch.compile (fullgraph; one graph for every depth and block of a "
        "shape, kept through delinks; hf_p2r.training.compile), hooks and activation checkpointing outside it.",
    )
    compile_backend: str = option("inductor", "torch.compile backend for compile (aot_eager: to debug or test).")
    loss_kernel: Literal["plain", "chunked", "liger", "auto"] = option(
        "plain",
        "The training and validation loss: plain (logits, then transformers' loss), chunked "
        "(hf_p2r.ops.linear_cross_entropy: no tokens x vocab logits), liger (Liger-Kernel's fused kernel, CUDA), "
        "auto (liger where installed on CUDA, else chunked).",
    )


@section
@dataclass
class CheckpointArguments:
    """Where the run writes and how it checkpoints and resumes."""

    output_dir: str = option("runs/p2r", "Where checkpoints, models and metrics go.")
    overwrite_output_dir: bool = option(False, "Replace the outputs of an earlier run in output_dir.")
    resume_from_checkpoint: str | None = option(
        None,
        "A checkpoint folder, or 'latest' (newest in output_dir/checkpoints).",
    )
    save_steps: int = option(0, "Checkpoint every N steps (0: only at the end).", check=at_least(0))
    save_total_limit: int | None = option(2, "Keep the newest N checkpoints (None: all).", check=at_least(1))
    checkpoint_format: Literal["auto", "accelerate", "dcp"] = option(
        "auto",
        "How resume checkpoints are written: accelerate (Accelerate's save_state; a pipeline's stage-{rank}.pt "
        "files; resumed by the same layout) or dcp (torch.distributed.checkpoint: every process writes its shards"
        " under the model's global names; resumed by another data-parallel size, FSDP2, DeepSpeed ZeRO-3 or one "
        "process, another pipeline split or schedule; not granular offload or ZeRO-1/2). auto: dcp for several "
        "processes (and checkpoint_async) where DCP runs, as torchtitan saves, else accelerate. A resume reads "
        "either, whatever this says.",
    )
    checkpoint_async: bool = option(
        False,
        "Save DCP checkpoints asynchronously (torch.distributed.checkpoint.async_save): the state is copied to "
        "CPU memory, training goes on while a background thread writes it, and the checkpoint is renamed into "
        "place when the write completes (hf_p2r.training.checkpointing).",
    )
    remote_code: bool = option(
        False,
        "Save the modeling code with pseudo/ and real/ (config.json's auto_map), for loading with "
        "trust_remote_code=True where hf-p2r is not installed. Off: the folders load after `import hf_p2r` with "
        "AutoModelForCausalLM and AutoTokenizer as they are, and transformers asks nothing.",
    )


@section
@dataclass
class LoggingArguments:
    """What the run logs and evaluates, and where the logs go."""

    logging_steps: int = option(10, "Write a metrics.jsonl record every N steps.", check=at_least(1))
    eval_steps: int = option(50, "Validation loss every N steps (0: only at the end).", check=at_least(0))
    eval_blocks: int = option(64, "Validation blocks per evaluation, spread over the split.", check=at_least(1))
    report_to: str = option("none", "accelerate trackers: none, tensorboard, wandb, all.")


def even_delink_steps(pseudo_steps: int, count: int) -> list[int]:
    """`count` partial delinks evenly spaced over a pseudo stage of `pseudo_steps` steps: the i-th at
    round(pseudo_steps * i / (count + 1)) (halves up), increasing and within (0, pseudo_steps) when
    pseudo_steps > count.

    ```python
    >>> even_delink_steps(80, 2), even_delink_steps(3300, 4)  # configs/demo.yaml, configs/gpu_1b.yaml
    ([27, 53], [660, 1320, 1980, 2640])
    ```
    """
    return [(2 * pseudo_steps * i + count + 1) // (2 * (count + 1)) for i in range(1, count + 1)]


@dataclass(frozen=True)
class LearningRateSchedule:
    """The learning rate of a run as a function of the step, resolved from the optimizer's peak (`learning_rate`), the
    schedule section and the run's length: what `hf_p2r.training.optim.learning_rate_at` reads (a `TrainArguments`
    has the same attributes)."""

    learning_rate: float
    lr_scheduler: str
    warmup_steps: int
    schedule_steps: int  # `lr_schedule_steps`, else pseudo_steps + real_steps
    decay_steps: int  # wsd: the last `lr_decay_fraction` of them (at least 1)
    min_lr_ratio: float
    lr_after_delink: str
    rewarm_steps: int

    @classmethod
    def of(cls, optim, schedule, stages) -> "LearningRateSchedule":
        steps = schedule.lr_schedule_steps or stages.total_steps
        return cls(
            learning_rate=optim.learning_rate,
            lr_scheduler=schedule.lr_scheduler,
            warmup_steps=schedule.warmup_steps,
            schedule_steps=steps,
            decay_steps=max(1, round(schedule.lr_decay_fraction * steps)),
            min_lr_ratio=schedule.min_lr_ratio,
            lr_after_delink=schedule.lr_after_delink,
            rewarm_steps=schedule.rewarm_steps,
        )


# The sections of a run, by their name in `TrainConfig` (and `--help`'s order).
SECTIONS: dict[str, type] = {
    "model": ModelArguments,
    "data": DataArguments,
    "stages": StageArguments,
    "optim": OptimizerArguments,
    "schedule": ScheduleArguments,
    "offload": OffloadArguments,
    "parallel": ParallelArguments,
    "compute": ComputeArguments,
    "checkpointing": CheckpointArguments,
    "logging": LoggingArguments,
}
# Each field's section (the flat keys: a field's name is unique over the sections).
SECTION_OF: dict[str, type] = {name: cls for cls in SECTIONS.values() for name in cls.__dataclass_fields__}
