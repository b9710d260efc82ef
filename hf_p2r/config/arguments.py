"""The trainer's fields, in three dataclasses: `ModelArguments` (the model's shape), `DataArguments` (the text and its
blocks), `TrainArguments` (the schedule and how it runs). Each field is a YAML key and a `--flag` of the same name
(`hf_p2r.config.parse`), with its type, default and help declared here; a value that does not fit its field is one
`ConfigError` naming it. Rules that compare fields of several dataclasses are in `rules`.

Plain Python (no torch, no transformers).
"""

from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ..distributed.pipeline.schedules import SCHEDULES, get_schedule
from .fields import ConfigError, check_range, check_types, short

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


@dataclass
class ModelArguments:
    """Shape of the model: Llama's fields (or a Llama / P2R config.json, `model_config`) and the pseudo model's k. The
    run starts from a pseudo model with `num_unique_layers` blocks (unless `pseudo_steps` is 0: then it trains the real
    model from scratch)."""

    model_config: str | None = field(
        default=None,
        metadata={
            "help": "A Llama or P2R config.json (a file, a model folder, or a Hub model id already in the local cache: "
            "read offline) whose fields are the model fields' values; the YAML file and the flags override them."
        },
    )
    hidden_size: int = field(default=128, metadata={"help": "Width of the residual stream."})
    intermediate_size: int = field(default=512, metadata={"help": "Width of the SwiGLU MLP."})
    num_hidden_layers: int = field(default=8, metadata={"help": "Depth L (of the pseudo and of the real model)."})
    num_attention_heads: int = field(default=4, metadata={"help": "Query heads."})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "KV heads (default: query heads)."})
    num_unique_layers: int = field(
        default=1, metadata={"help": "k, the distinct blocks of the pseudo model (unused when pseudo_steps is 0)."}
    )
    sharing_pattern: Literal["cycle", "sequence"] = field(
        default="cycle", metadata={"help": "cycle: depth i runs block i mod k; sequence: block floor(i*k/L)."}
    )
    vocab_size: int | None = field(
        default=None, metadata={"help": "Embedding rows (default: the tokenizer's size rounded up to 64)."}
    )
    tie_word_embeddings: bool = field(default=False, metadata={"help": "Share the input and output embeddings."})
    initializer_range: float = field(default=0.02, metadata={"help": "Std of the initial weights."})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base."})
    rope_scaling: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "RoPE scaling beyond rope_theta, as transformers' rope_parameters take it: rope_type and its "
            "fields, e.g. {rope_type: linear, factor: 2.0} (YAML; a flag takes the same text)."
        },
    )
    max_position_embeddings: int | None = field(
        default=None,
        metadata={"help": "Longest sequence the model is declared for, kept in its saves (default: block_size)."},
    )
    head_dim: int | None = field(default=None, metadata={"help": "Width of a head (default: hidden_size / heads)."})
    hidden_act: str = field(default="silu", metadata={"help": "The MLP's activation (transformers' ACT2FN names)."})
    rms_norm_eps: float = field(default=1e-6, metadata={"help": "Epsilon of the RMS norms."})
    attention_bias: bool = field(default=False, metadata={"help": "Biases in the attention projections."})
    attention_dropout: float = field(default=0.0, metadata={"help": "Dropout of the attention weights in training."})
    mlp_bias: bool = field(default=False, metadata={"help": "Biases in the MLP projections."})
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "Attention kernel: sdpa, eager, flash_attention_2, ..."}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in the backward pass to save memory."}
    )
    # Mixture of experts (P2RMoeConfig's fields; checked by it).
    num_experts: int = field(default=0, metadata={"help": "Experts per sparse layer; 0: a dense model."})
    num_experts_per_tok: int = field(default=2, metadata={"help": "Experts per token (top-k)."})
    moe_intermediate_size: int | None = field(
        default=None, metadata={"help": "Width of each expert (default: intermediate_size)."}
    )
    decoder_sparse_step: int = field(default=1, metadata={"help": "Depth d is sparse when d + 1 is a multiple."})
    mlp_only_layers: list[int] = field(default_factory=list, metadata={"help": "Depths that stay dense."})
    norm_topk_prob: bool = field(default=True, metadata={"help": "Renormalise the top-k routing weights."})
    num_expert_groups: int = field(
        default=1, metadata={"help": "M6-T expert prototyping: top-1 in each of this many groups."}
    )
    router_aux_loss_coef: float = field(default=0.001, metadata={"help": "Weight of the load-balancing loss."})

    def __post_init__(self):
        check_types(self)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            check_range(name, getattr(self, name), low=1)
        check_range("num_key_value_heads", self.num_key_value_heads, low=1)
        check_range("num_unique_layers", self.num_unique_layers, low=1)
        check_range("vocab_size", self.vocab_size, low=1)
        check_range("initializer_range", self.initializer_range, low=0.0, strict_low=True)
        check_range("rope_theta", self.rope_theta, low=0.0, strict_low=True)
        check_range("max_position_embeddings", self.max_position_embeddings, low=1)
        check_range("head_dim", self.head_dim, low=1)
        check_range("rms_norm_eps", self.rms_norm_eps, low=0.0, strict_low=True)
        check_range("attention_dropout", self.attention_dropout, low=0.0, high=1.0, strict_high=True)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling.get("rope_type"), str):
            raise ConfigError(
                f"rope_scaling: needs a rope_type (linear, dynamic, yarn, llama3, ...), got {short(self.rope_scaling)}"
            )
        kv_heads = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv_heads:
            raise ConfigError(
                f"num_key_value_heads: {kv_heads} must divide num_attention_heads ({self.num_attention_heads})"
            )


@dataclass
class DataArguments:
    """Where the text comes from and how it is cut into training blocks. With no `dataset_name` and no
    `train_files`, the corpus is a deterministic subset of the Python standard library's sources (no download)."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset to download (only when set), e.g. Salesforce/wikitext."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_files: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Local .txt/.md/.py (one document per file), .json/.jsonl or .parquet files, or folders of them."
        },
    )
    text_column: str = field(
        default="text", metadata={"help": "Column holding the text (JSON, Parquet and Hub datasets)."}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream dataset_name or train_files (.jsonl/.parquet/text shards): read, split per process, "
            "tokenized and packed on the fly, resumed exactly from the position each checkpoint keeps."
        },
    )
    validation_files: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A streaming run's held-out files (default: the Hub dataset's validation split); each evaluation "
            "reads their first eval_blocks blocks."
        },
    )
    corpus_max_bytes: int = field(
        default=2_000_000, metadata={"help": "Size of the built-in standard-library corpus, in bytes."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer folder or Hub name (default: the built-in byte-level tokenizer)."}
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence (documents are packed)."})
    validation_fraction: float = field(default=0.05, metadata={"help": "Share of the blocks held out for validation."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    cache_dir: str | None = field(default=None, metadata={"help": "datasets cache folder (default: HF's)."})

    def __post_init__(self):
        check_types(self)
        check_range("corpus_max_bytes", self.corpus_max_bytes, low=1)
        check_range("block_size", self.block_size, low=2)
        check_range(
            "validation_fraction", self.validation_fraction, low=0.0, high=1.0, strict_low=True, strict_high=True
        )
        check_range("preprocessing_num_workers", self.preprocessing_num_workers, low=1)
        if self.dataset_name and self.train_files:
            raise ConfigError("train_files: give either dataset_name (Hub) or train_files (local), not both")
        if self.streaming and not (self.dataset_name or self.train_files):
            raise ConfigError("streaming: give dataset_name or train_files to stream (the built-in corpus is not)")
        if self.validation_files and not self.streaming:
            raise ConfigError(
                "validation_files: read by a streaming run only (streaming: true); a map-style run holds out "
                "validation_fraction of its blocks"
            )
        if self.streaming and self.train_files and not self.validation_files:
            raise ConfigError("validation_files: a streaming run of train_files needs held-out files to evaluate on")


@dataclass
class TrainArguments:
    """The schedule: `pseudo_steps` on the pseudo model, delink, `real_steps` on the real model."""

    output_dir: str = field(default="runs/p2r", metadata={"help": "Where checkpoints, models and metrics go."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace the outputs of an earlier run in output_dir."}
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "A checkpoint folder, or 'latest' (newest in output_dir/checkpoints)."}
    )
    seed: int = field(default=0, metadata={"help": "Seeds the initial weights, the data split and the data order."})
    pseudo_steps: int = field(
        default=100, metadata={"help": "Optimizer steps before delinking to the real model (0: train it from scratch)."}
    )
    real_steps: int = field(default=100, metadata={"help": "Optimizer steps on the real model."})
    partial_delink_steps: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Step of each partial delink, increasing, in (0, pseudo_steps). Default: evenly spaced over the "
            "pseudo stage (the i-th of n at round(pseudo_steps * i / (n + 1))), so they follow --pseudo_steps."
        },
    )
    partial_delink_blocks: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Blocks after each partial delink in the pseudo stage, e.g. 2 4 (1 -> 2 -> 4 -> L); unused when "
            "pseudo_steps is 0."
        },
    )
    optimizer_carry: Literal["reset", "copy", "scale"] = field(
        default="scale",
        metadata={
            "help": "Adam state of the delinked layers: reset (fresh), copy (the shared moments), or scale (moments "
            "times n'/n, squared moments times (n'/n)^2, n = depths a block served before, n' after)."
        },
    )
    shared_lr_scale: Literal["none", "depth"] = field(
        default="depth",
        metadata={
            "help": "Learning rate of a shared block: depth (divided by the number of depths the block runs at, so its "
            "update moves the function as much as an unshared block's; logged as lr_shared, the most shared block's; "
            "see benchmarks/convergence_carry.md) or none (the same as every parameter)."
        },
    )
    lr_after_delink: Literal["continue", "rewarm"] = field(
        default="continue", metadata={"help": "continue the schedule, or rewarm it over rewarm_steps after delinking."}
    )
    rewarm_steps: int = field(default=20, metadata={"help": "Length of the warm-up after a delink (rewarm)."})
    per_device_batch_size: int = field(default=16, metadata={"help": "Blocks per micro-batch per process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = field(
        default="cosine",
        metadata={
            "help": "Decay over the schedule's steps (lr_schedule_steps), after warmup_steps; wsd: "
            "warmup-stable-decay, the peak rate until the last lr_decay_fraction of the schedule, then a 1-sqrt decay "
            "to the floor."
        },
    )
    lr_decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd: the fraction of the run (all steps) spent decaying, in (0, 1]."}
    )
    warmup_steps: int = field(
        default=20, metadata={"help": "Linear warm-up at the start of the run (at most lr_schedule_steps)."}
    )
    lr_schedule_steps: int | None = field(
        default=None,
        metadata={
            "help": "Steps the learning-rate schedule spans, its last at min_lr_ratio (default: pseudo_steps + "
            "real_steps). A resume that changes the run's length keeps the saved schedule's (steps past its end run "
            "at the final rate) unless this is given."
        },
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final learning rate / peak (cosine, linear, wsd)."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices and embeddings only)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    optimizer: Literal["adamw", "muon"] = field(
        default="adamw",
        metadata={
            "help": "adamw, or muon: torch.optim.Muon for the blocks' matrices (an MoE model's experts one expert at a "
            "time), AdamW for the embeddings, norms, head and biases (hf_p2r.training.optim.MuonAdamW)."
        },
    )
    muon_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Peak Muon learning rate, on the same schedule (default: learning_rate; with match_rms_adamw, Muon "
            "takes AdamW's rate and weight decay, arXiv 2502.16982)."
        },
    )
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon momentum (torch.optim.Muon's default)."})
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = field(
        default="match_rms_adamw",
        metadata={
            "help": "torch.optim.Muon's learning-rate adjustment per matrix shape: match_rms_adamw (0.2 sqrt(max(A, "
            "B)): updates of AdamW's RMS, Moonshot's) or original (sqrt(max(1, A/B)), Keller Jordan's)."
        },
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (0: off)."})
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None, metadata={"help": "Default: what `accelerate config` / `accelerate launch` says."}
    )
    cpu: bool | None = field(
        default=None, metadata={"help": "Train on CPU (gloo for several processes). Default: when no accelerator."}
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "Compile each decoder block with torch.compile (fullgraph; one graph for every depth and block of "
            "a shape, kept through delinks; hf_p2r.training.compile), hooks and activation checkpointing outside it."
        },
    )
    compile_backend: str = field(
        default="inductor", metadata={"help": "torch.compile backend for compile (aot_eager: to debug or test)."}
    )
    loss_kernel: Literal["plain", "chunked", "liger", "auto"] = field(
        default="plain",
        metadata={
            "help": "The training and validation loss: plain (logits, then transformers' loss), chunked "
            "(hf_p2r.ops.linear_cross_entropy: no tokens x vocab logits), liger (Liger-Kernel's fused kernel, CUDA), "
            "auto (liger where installed on CUDA, else chunked)."
        },
    )
    logging_steps: int = field(default=10, metadata={"help": "Write a metrics.jsonl record every N steps."})
    eval_steps: int = field(default=50, metadata={"help": "Validation loss every N steps (0: only at the end)."})
    eval_blocks: int = field(default=64, metadata={"help": "Validation blocks per evaluation, spread over the split."})
    save_steps: int = field(default=0, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep the newest N checkpoints (None: all)."})
    checkpoint_format: Literal["auto", "accelerate", "dcp"] = field(
        default="auto",
        metadata={
            "help": "How resume checkpoints are written: accelerate (Accelerate's save_state; a pipeline's stage-{rank}"
            ".pt files; resumed by the same layout) or dcp (torch.distributed.checkpoint: every process writes its "
            "shards under the model's global names; resumed by another data-parallel size, FSDP2, DeepSpeed ZeRO-3 or "
            "one process, another pipeline split or schedule; not granular offload or ZeRO-1/2). auto: dcp for "
            "several processes (and checkpoint_async) where DCP runs, as torchtitan saves, else accelerate. A resume "
            "reads either, whatever this says."
        },
    )
    checkpoint_async: bool = field(
        default=False,
        metadata={
            "help": "Save DCP checkpoints asynchronously (torch.distributed.checkpoint.async_save): the state "
            "is copied to CPU memory, training goes on while a background thread writes it, and the checkpoint is "
            "renamed into place when the write completes (hf_p2r.training.checkpointing)."
        },
    )
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none, tensorboard, wandb, all."})
    remote_code: bool = field(
        default=True, metadata={"help": "Save the modeling code with pseudo/ and real/ (trust_remote_code)."}
    )
    offload: str | None = field(
        default=None,
        metadata={
            "help": "Granular CPU offload of blocks (one process): auto, a ratio of blocks (0.5) or block indices "
            "([1, 3, 5]: blocks of the first model, which a pseudo model with k blocks numbers 0..k-1); re-selected "
            "after every delink, so auto offloads nothing while the pseudo model fits."
        },
    )
    offload_budget_gb: float | None = field(
        default=None,
        metadata={"help": "Device memory offload: auto plans for (default on CUDA: 85%% of it; needed on a CPU run)."},
    )
    offload_prefetch: int = field(default=1, metadata={"help": "Offloaded blocks copied ahead of their use."})
    offload_optimizer: Literal["host", "device_chunked"] = field(
        default="host",
        metadata={
            "help": "Where the offloaded blocks' optimizer step runs: host (the CPU, over CPU state) or device_chunked "
            "(the compute device, offload_chunk_mb at a time, the state kept in pinned host memory: Megatron-Core's "
            "chunked optimizer-state offload)."
        },
    )
    offload_chunk_mb: float = field(
        default=256.0,
        metadata={"help": "device_chunked: MiB of parameters, gradients and optimizer state stepped at a time."},
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={"help": "Pipeline stages (processes) the model is split into by depth (hf_p2r.distributed)."},
    )
    pipeline_schedule: Literal[SCHEDULES] = field(  # the registry's names (hf_p2r.distributed.pipeline.schedules)
        default="1f1b",
        metadata={"help": "Pipeline schedule: torch's gpipe, 1f1b, interleaved_1f1b, zero_bubble, or PipeDream-2BW."},
    )
    pipeline_delay_correction: Literal["none", "error_feedback"] = field(
        default="none",
        metadata={
            "help": "2bw: error_feedback adds to each delayed update the error of the one before it (the update "
            "computed one step later minus the update applied; hf_p2r.distributed.pipeline.pipedream), for either "
            "optimizer; none: the plain delayed update."
        },
    )
    num_microbatches: int | None = field(
        default=None,
        metadata={"help": "Micro-batches per optimizer step in a pipeline (default: pipeline_parallel_size)."},
    )
    pipeline_split: list[int] | None = field(
        default=None,
        metadata={"help": "Layers per stage, e.g. 3 5 (YAML: [3, 5]; default: balanced from FLOPs and bytes)."},
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Data-parallel pipelines beside pipeline_parallel_size (a 2-D mesh of data_parallel_size x "
            "pipeline_parallel_size processes); each reads per_device_batch_size blocks per step. With "
            "pipeline_parallel_size 1 the whole model is one stage on each of the data_parallel_size processes "
            "(torchrun; on CPU too): FSDP2-sharded with data_parallel_shard, else replicated, gradients averaged as "
            "DDP does; num_microbatches is then gradient accumulation (gpipe or 1f1b)."
        },
    )
    data_parallel_shard: bool = field(
        default=False,
        metadata={
            "help": "Shard each pipeline stage with FSDP2 over the data-parallel pipelines (weights, gradients and "
            "optimizer state split data_parallel_size ways; with pipeline_parallel_size 1, the whole model: FSDP2 "
            "applied by the trainer itself); default: replicated stages that average gradients."
        },
    )

    def __post_init__(self):
        self.offload = offload_text(self.offload)
        check_types(self)
        if parse_offload(self.offload) is None:  # "none" is no offload, like leaving it out
            self.offload = None
        check_range("offload_budget_gb", self.offload_budget_gb, low=0.0, strict_low=True)
        if self.cpu:
            self.check_offload_budget("cpu")
        check_range("offload_prefetch", self.offload_prefetch, low=0)
        check_range("offload_chunk_mb", self.offload_chunk_mb, low=0.0, strict_low=True)
        for name in ("pseudo_steps", "real_steps", "warmup_steps", "eval_steps", "save_steps"):
            check_range(name, getattr(self, name), low=0)
        for name in ("rewarm_steps", "per_device_batch_size", "gradient_accumulation_steps", "logging_steps"):
            check_range(name, getattr(self, name), low=1)
        check_range("eval_blocks", self.eval_blocks, low=1)
        check_range("save_total_limit", self.save_total_limit, low=1)
        check_range("learning_rate", self.learning_rate, low=0.0, strict_low=True)
        check_range("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        check_range("lr_decay_fraction", self.lr_decay_fraction, low=0.0, high=1.0, strict_low=True)
        check_range("weight_decay", self.weight_decay, low=0.0)
        check_range("adam_beta1", self.adam_beta1, low=0.0, high=1.0, strict_high=True)
        check_range("adam_beta2", self.adam_beta2, low=0.0, high=1.0, strict_high=True)
        check_range("adam_epsilon", self.adam_epsilon, low=0.0, strict_low=True)
        check_range("muon_learning_rate", self.muon_learning_rate, low=0.0, strict_low=True)
        check_range("muon_momentum", self.muon_momentum, low=0.0, high=1.0, strict_high=True)
        if self.pipeline_delay_correction != "none" and (
            self.pipeline_parallel_size == 1 or self.pipeline_schedule != "2bw"
        ):
            raise ConfigError(
                "pipeline_delay_correction: corrects PipeDream-2BW's one-step delay (pipeline_schedule: 2bw with "
                f"pipeline_parallel_size > 1); this run has {self.pipeline_schedule} x{self.pipeline_parallel_size}, "
                "whose updates are not delayed"
            )
        check_range("max_grad_norm", self.max_grad_norm, low=0.0)
        if self.checkpoint_async and self.checkpoint_format == "accelerate":
            raise ConfigError(
                "checkpoint_async: asynchronous saves write DCP checkpoints (checkpoint_format: dcp), this run's "
                f"checkpoint_format is {self.checkpoint_format}"
            )
        if self.pseudo_steps + self.real_steps == 0:
            raise ConfigError("real_steps: pseudo_steps + real_steps must be at least 1")
        check_range("lr_schedule_steps", self.lr_schedule_steps, low=1)
        if self.warmup_steps > self.schedule_steps:
            spans = "pseudo_steps + real_steps" if self.lr_schedule_steps is None else "lr_schedule_steps"
            raise ConfigError(
                f"warmup_steps: the warm-up ({self.warmup_steps} steps) is longer than the run ({self.schedule_steps} "
                f"step{'s' * (self.schedule_steps != 1)}: {spans}); pass --warmup_steps {self.schedule_steps} or less"
            )
        check_range("pipeline_parallel_size", self.pipeline_parallel_size, low=1)
        check_range("num_microbatches", self.num_microbatches, low=1)
        check_range("data_parallel_size", self.data_parallel_size, low=1)
        if self.data_parallel_shard and self.data_parallel_size == 1:
            raise ConfigError(
                "data_parallel_shard: shards over data_parallel_size > 1 processes (or pipelines), got 1; with "
                "accelerate launch, FSDP2 is the launcher's config (configs/accelerate/fsdp2.yaml)"
            )
        if self.pipeline_parallel_size > 1 or self.data_parallel_size > 1:
            self._check_pipeline()
        if self.lr_scheduler == "wsd" and self.warmup_steps + self.decay_steps > self.schedule_steps:
            raise ConfigError(
                f"lr_decay_fraction: warm-up ({self.warmup_steps} steps) and decay ({self.decay_steps}) must fit in "
                f"the run ({self.schedule_steps} steps), got {self.lr_decay_fraction}"
            )

    def _check_pipeline(self) -> None:
        """Refuse, in one line naming the fields, what the pipeline engine (stages, or the whole model one stage over
        data_parallel_size processes) does not support."""
        schedule = get_schedule(self.pipeline_schedule)  # what it allows: the schedule registry
        try:
            schedule.check_one_stage(self.pipeline_parallel_size)
            if self.data_parallel_shard:
                schedule.check_shardable()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        engine = "pipeline_parallel_size > 1" if self.pipeline_parallel_size > 1 else "data_parallel_size > 1"
        refused = [
            ("offload", self.offload is not None, "granular offload runs in one process"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps != 1, "num_microbatches splits the batch"),
            ("mixed_precision", self.mixed_precision not in (None, "no"), "stages run in fp32 so far"),
            ("compile", self.compile, "stages run eagerly so far"),
            ("loss_kernel", self.loss_kernel != "plain", "the last stage computes the plain loss so far"),
        ]
        for name, bad, why in refused:
            if bad:
                raise ConfigError(f"{name}: not supported with {engine} ({why})")
        microbatches = self.num_microbatches or self.pipeline_parallel_size
        if self.per_device_batch_size % microbatches:
            raise ConfigError(
                f"num_microbatches: {microbatches} must divide per_device_batch_size ({self.per_device_batch_size}), "
                "the pipeline's batch"
            )
        try:
            schedule.check_microbatches(microbatches, self.pipeline_parallel_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def total_steps(self) -> int:
        return self.pseudo_steps + self.real_steps

    @property
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule spans: `lr_schedule_steps`, else the run's."""
        return self.lr_schedule_steps or self.total_steps

    @property
    def decay_steps(self) -> int:
        """Steps of the wsd schedule's decay (at least 1): the last `lr_decay_fraction` of the schedule."""
        return max(1, round(self.lr_decay_fraction * self.schedule_steps))

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


def offload_text(value: Any) -> Any:
    """`offload` in its canonical string form: YAML gives a number (0.5) or a list ([1, 3, 5]), the command line a
    string; anything else is returned as it is (for the type check to name)."""
    if isinstance(value, bool) or not isinstance(value, int | float | list):
        return value
    if isinstance(value, list) and not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    return str(value)


def parse_offload(text: str | None) -> str | float | list[int] | None:
    """ "auto" | "0.5" | "[1, 3, 5]" | None -> "auto" | 0.5 | [1, 3, 5] | None; `ConfigError("offload: ...")` else."""
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
    raise ConfigError(
        "offload: expected auto, a ratio between 0 and 1 (0.5) or a list of block indices ([1, 3, 5]), got "
        f"{short(text)}"
    )
