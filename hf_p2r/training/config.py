"""Training configuration: three dataclasses read from a YAML file, then overridden from the command line.

```bash
accelerate launch scripts/train.py --config configs/demo.yaml --pseudo_steps 50 --optimizer_carry copy
```

Keys are flat (as in transformers' `run_clm.py`): every field of `ModelArguments`, `DataArguments` and
`TrainArguments` is both a YAML key and a `--flag` (spelled out: no abbreviations). A list flag takes its values one
after the other (`--partial_delink_blocks 2 4`); `none`, `[]` or no value clears it. Every bad input, whatever the YAML
file or the command line holds, raises one `ConfigError` (a `ValueError`) of one line naming the field, the key or the
file, and the problem.
"""

import argparse
import dataclasses
import difflib
import math
import os
import re
import reprlib
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from huggingface_hub.errors import StrictDataclassError
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from ..distributed.pipeline.schedules import SCHEDULES, get_schedule
from ..errors import InputError
from ..models.p2r import P2RConfig, P2RMoeConfig, delink_sources


class ConfigError(InputError):
    """A bad configuration (exit code 2 from the trainer's command line), wherever it is found: while parsing, or at
    run time for what only the run can check (e.g. `offload: auto` with no device memory to plan for)."""


# The largest YAML configuration the trainer reads (the presets are a few kB).
MAX_CONFIG_BYTES = 1 << 20


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
    """Shape of the model. The run starts from a pseudo model with `num_unique_layers` blocks (unless
    `pseudo_steps` is 0: then it trains the real model from scratch)."""

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
            "help": "Local .txt/.md/.rst/.py (split into documents: text_document_separator), .json/.jsonl or "
            ".parquet files (a record is a document), or folders of them."
        },
    )
    text_column: str = field(
        default="text", metadata={"help": "Column holding the text (JSON, Parquet and Hub datasets)."}
    )
    text_document_separator: str | None = field(
        default=None,
        metadata={
            "help": "Where a text file (.txt/.md/.py/.rst) splits into documents: a string (escapes \\n \\t \\f "
            "read as such, e.g. '\\n\\n\\n' or '<|endoftext|>'), or '' for one document per file. Default: at "
            "blank lines (a line of whitespace only) in .txt/.md/.rst files; each .py file is one document."
        },
    )
    allow_data_change: bool = field(
        default=False,
        metadata={
            "help": "Resume on training data that differs from the checkpoint's (files added, removed or modified) "
            "with a one-line warning, instead of refusing: its data position then points into other data."
        },
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
    validation_fraction: float = field(
        default=0.05,
        metadata={"help": "Share of the text held out for validation, by whole documents (map-style runs)."},
    )
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
            "help": "Decay over pseudo_steps + real_steps, after warmup_steps; wsd: warmup-stable-decay, the peak "
            "rate until the last lr_decay_fraction of the run, then a 1-sqrt decay to the floor."
        },
    )
    lr_decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd: the fraction of the run (all steps) spent decaying, in (0, 1]."}
    )
    warmup_steps: int = field(
        default=20, metadata={"help": "Linear warm-up at the start of the run (at most pseudo_steps + real_steps)."}
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
    checkpoint_format: Literal["accelerate", "dcp"] = field(
        default="accelerate",
        metadata={
            "help": "How resume checkpoints are written: accelerate (Accelerate's save_state; a pipeline's stage-{rank}"
            ".pt files; resumed by the same layout) or dcp (torch.distributed.checkpoint: every process writes its "
            "shards under the model's global names; resumed by another data-parallel size, FSDP2, DeepSpeed ZeRO-3 or "
            "one process, another pipeline split or schedule; not granular offload or ZeRO-1/2). A resume reads "
            "either, whatever this says."
        },
    )
    checkpoint_async: bool = field(
        default=False,
        metadata={
            "help": "checkpoint_format dcp: save asynchronously (torch.distributed.checkpoint.async_save): the state "
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
        if self.compile:
            _check_compile_backend(self.compile_backend)
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
        if self.checkpoint_async and self.checkpoint_format != "dcp":
            raise ConfigError(
                "checkpoint_async: asynchronous saves write DCP checkpoints (checkpoint_format: dcp), this run's "
                f"checkpoint_format is {self.checkpoint_format}"
            )
        if self.pseudo_steps + self.real_steps == 0:
            raise ConfigError("real_steps: pseudo_steps + real_steps must be at least 1")
        if self.warmup_steps > self.total_steps:
            raise ConfigError(
                f"warmup_steps: the warm-up ({self.warmup_steps} steps) is longer than the run ({self.total_steps} "
                f"step{'s' * (self.total_steps != 1)}: pseudo_steps + real_steps); pass --warmup_steps "
                f"{self.total_steps} or less"
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
        if self.lr_scheduler == "wsd" and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ConfigError(
                f"lr_decay_fraction: warm-up ({self.warmup_steps} steps) and decay ({self.decay_steps}) must fit in "
                f"the run ({self.total_steps} steps), got {self.lr_decay_fraction}"
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
    def decay_steps(self) -> int:
        """Steps of the wsd schedule's decay (at least 1): the last `lr_decay_fraction` of the run."""
        return max(1, round(self.lr_decay_fraction * self.total_steps))

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


def _check_compile_backend(backend: str) -> None:
    """`ConfigError` naming the field unless `backend` is one of torch.compile's registered backends."""
    import torch  # (at the check: the configuration's other readers need no torch)

    if backend not in torch.compiler.list_backends(exclude_tags=()):  # debugging backends (aot_eager, eager) included
        known = ", ".join(["aot_eager", "eager", *torch.compiler.list_backends()])
        raise ConfigError(f"compile_backend: {backend!r} is not a torch.compile backend ({known})")


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
        f"{_short(text)}"
    )


@dataclass
class TrainConfig:
    """The whole run: `config.model`, `config.data`, `config.train`."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments

    def to_dict(self) -> dict[str, Any]:
        """Flat {field: value}, the YAML layout (recorded in every checkpoint and given to trackers), resolved: the
        partial delinks' steps are the ones the run takes (`delink_schedule`), also where they were left to default."""
        values = {**dataclasses.asdict(self.model), **dataclasses.asdict(self.data), **dataclasses.asdict(self.train)}
        if self.train.pseudo_steps:
            values["partial_delink_steps"] = [step for step, _ in self.delink_schedule()[:-1]]
        return values

    def delink_schedule(self) -> list[tuple[int, int]]:
        """[(step, blocks after the delink at that step)], ending with (pseudo_steps, L); empty for a scratch run.

        The one place the schedule is resolved (the trainer, the pipelined trainer and the planner read it): the
        partial delinks' steps are `partial_delink_steps`, or, left out, evenly spaced over the pseudo stage
        (`even_delink_steps`).

        ```python
        >>> config = parse_config(["--config", "configs/demo.yaml", "--pseudo_steps", "50"])
        >>> config.delink_schedule()  # partial_delink_blocks: [2, 4], 8 layers
        [(17, 2), (33, 4), (50, 8)]
        ```
        """
        t = self.train
        if t.pseudo_steps == 0:
            return []
        steps = t.partial_delink_steps or even_delink_steps(t.pseudo_steps, len(t.partial_delink_blocks))
        return [*zip(steps, t.partial_delink_blocks), (t.pseudo_steps, self.model.num_hidden_layers)]

    def initial_blocks(self) -> int:
        """Blocks of the model at step 0: k for a P2R run, L for a real model trained from scratch."""
        return self.model.num_unique_layers if self.train.pseudo_steps else self.model.num_hidden_layers

    def blocks_at(self, step: int) -> int:
        """Blocks the model must have once every delink due at `step` (or before) is done."""
        blocks = self.initial_blocks()
        for delink_step, new_blocks in self.delink_schedule():
            if delink_step <= step:
                blocks = new_blocks
        return blocks

    def p2r_config(self, vocab_size: int, num_blocks: int, special_tokens: dict[str, int | None]) -> P2RConfig:
        """The model's P2RConfig with `num_blocks` blocks (k < L: pseudo; L: real); a P2RMoeConfig if `num_experts`."""
        m, depth = self.model, self.model.num_hidden_layers
        config_class, moe = P2RConfig, {}
        if m.num_experts:
            config_class = P2RMoeConfig
            moe = {name: getattr(m, name) for name in MOE_FIELDS}
        try:
            return config_class(
                vocab_size=vocab_size,
                hidden_size=m.hidden_size,
                intermediate_size=m.intermediate_size,
                num_hidden_layers=depth,
                num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads or m.num_attention_heads,
                max_position_embeddings=self.data.block_size,
                initializer_range=m.initializer_range,
                tie_word_embeddings=m.tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                share_layers=num_blocks < depth,
                num_unique_layers=num_blocks if num_blocks < depth else None,
                sharing_pattern=m.sharing_pattern,
                attn_implementation=m.attn_implementation,
                **special_tokens,
                **moe,
            )
        except (StrictDataclassError, ValueError) as error:
            # huggingface_hub wraps the validator's message in context lines: keep the message of the last one.
            message = str(error).strip().splitlines()[-1].strip()
            raise ConfigError(f"model: {re.sub(r'^[A-Za-z]+Error: ', '', message)}") from None


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


def parse_config(argv: list[str] | None = None, prog: str = "train.py") -> TrainConfig:
    """`--config FILE` (YAML, flat keys) plus `--field value` overrides -> `TrainConfig`.

    Raises `ConfigError` (a `ValueError`), one line naming the field, the YAML key and file, or the bad flag, for any
    bad input; `--help` prints every field (under the command name `prog`) and exits.
    """
    pre = _ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    parser = _Parser(
        (ModelArguments, DataArguments, TrainArguments),
        prog=prog,
        usage="%(prog)s [--config FILE] [--FIELD VALUE ...]",
        description="P2R pretraining: pseudo stage -> delink -> real stage. Every --FIELD is also a YAML key; a list "
        "--FIELD takes its values one after the other (none, [] or no value: an empty list).",
        allow_abbrev=False,  # --pseudo_step must not be taken for --pseudo_steps
    )
    parser.add_argument("--config", help="YAML file of FIELD: VALUE lines; flags on the command line override it.")
    if known.config is not None:
        parser.set_defaults(**_read_yaml(Path(known.config)))
    model, data, train, _, unknown = parser.parse_args_into_dataclasses(
        rest, return_remaining_strings=True, look_for_args_file=False
    )
    if unknown:
        flag = next((token for token in unknown if token.startswith("--")), "").partition("=")[0][2:].replace("-", "_")
        close = difflib.get_close_matches(flag, _fields(), n=1) if 0 < len(flag) < 100 else []
        hint = f"did you mean --{close[0]}? " if close else ""
        shown = " ".join(token if token and token.isprintable() else repr(token) for token in unknown)
        raise ConfigError(f"unrecognized arguments: {_one_line(shown)} ({hint}see --help for the fields)")
    config = TrainConfig(model, data, train)
    # Shape errors (e.g. heads not dividing the width) now rather than after the data is tokenized; the model's own
    # validators bound the sizes before anything below scales with the depth.
    config.p2r_config(vocab_size=model.vocab_size or 256, num_blocks=config.initial_blocks(), special_tokens={})
    _check_schedule(config)
    _check_offload(config)
    return config


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse prints the whole usage and exits; we want one line from the caller.
        raise ConfigError(_one_line(message))


class _Parser(_ArgumentParser, HfArgumentParser):
    def add_argument(self, *args, **kwargs):
        # HfArgumentParser gives a list field nargs="+": at least one value, so no command line could clear a list.
        if kwargs.get("nargs") == "+":
            empty = None if kwargs.get("default") is None else []  # None for an optional list (pipeline_split)
            kwargs.update(nargs="*", action=_list_action(kwargs.pop("type"), empty))
        return super().add_argument(*args, **kwargs)


def _list_action(item_type: type, empty: list | None) -> type[argparse.Action]:
    """The action of a list flag: values converted by `item_type`; `none`, `[]` or no value give `empty`."""

    class ListAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if values in ([], ["none"], ["[]"]):
                setattr(namespace, self.dest, empty)
                return
            converted = []
            for value in values:
                try:
                    converted.append(item_type(value))
                except (TypeError, ValueError):
                    raise argparse.ArgumentError(self, f"invalid {item_type.__name__} value: {_short(value)}") from None
            setattr(namespace, self.dest, converted)

    return ListAction


def _fields() -> dict[str, Any]:
    """{field name: its annotation} of the three argument dataclasses: the YAML keys."""
    hints = {}
    for arguments in (ModelArguments, DataArguments, TrainArguments):
        hints.update(typing.get_type_hints(arguments))
    return hints


def _read_yaml(path: Path) -> dict[str, Any]:
    """The FIELD: VALUE pairs of YAML file `path`, each converted to its field's type as the command line converts a
    value (a string "3e-4" read as a number) and checked against it; `ConfigError` naming the file for anything else:
    a path that is not a regular file (a FIFO or a device is never read, so never blocks), over `MAX_CONFIG_BYTES`,
    not UTF-8, not YAML (nested too deeply included), not a mapping, an unknown key, a value of the wrong type."""
    shown = str(path) if str(path).isprintable() else repr(str(path))
    text = _read_text(path, shown)
    try:
        values = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"config: {shown} is not valid YAML (nested too deeply)") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as error:  # PyYAML's constructors raise the latter
        raise ConfigError(f"config: {shown} is not valid YAML ({_yaml_problem(error)})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config: {shown} must hold FIELD: VALUE lines, got a {type(values).__name__}")
    fields = _fields()
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1) if isinstance(key, str) and len(key) < 100 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config: {shown}: unknown key {_short(key)}{hint}")
    converted = {}
    for key, value in values.items():
        annotation = fields[key]
        value = offload_text(value) if key == "offload" else _from_yaml(value, annotation)
        if not _matches(value, annotation):
            expected = _describe(annotation) if key != "offload" else "auto, a ratio (0.5) or block indices ([1, 3])"
            raise ConfigError(f"config: {shown}: {key}: expected {expected}, got {_short(value)}")
        converted[key] = value
    return converted


def _read_text(path: Path, shown: str) -> str:
    try:
        # Non-blocking: opening a FIFO for reading returns at once (and is then refused) instead of waiting.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        raise ConfigError(f"config: cannot read {shown}: {error.strerror}") from None
    except ValueError:  # a NUL character in the path
        raise ConfigError(f"config: cannot read {shown}: not a valid path") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ConfigError(f"config: {shown} is not a regular file")
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(MAX_CONFIG_BYTES + 1)  # bounded, also for a file that grows
        except OSError as error:
            raise ConfigError(f"config: cannot read {shown}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {shown} is over {MAX_CONFIG_BYTES >> 20} MiB, too large for a configuration")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: {shown} is not UTF-8 text (byte {error.start})") from None


def _yaml_problem(error: Exception) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        where = f"line {error.problem_mark.line + 1}: " if error.problem_mark else ""
        context = f"{error.context}, " if error.context else ""
        return _one_line(where + context + error.problem)
    return _one_line(str(error)) or type(error).__name__


def _from_yaml(value: Any, annotation) -> Any:
    """A YAML value as the command line would give it: a string converted to the number or boolean the field takes
    (YAML reads 3e-4 as a string), null for a list field as the empty list (`--FIELD none`), false for a choice of
    "no" as "no"."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = args or (annotation,)
    if value is None and type(None) not in kinds and any(typing.get_origin(kind) is list for kind in kinds):
        return []
    if value is False and any(typing.get_origin(kind) is Literal and "no" in typing.get_args(kind) for kind in kinds):
        return "no"  # YAML 1.1 reads `mixed_precision: no` as false
    if isinstance(value, str):
        for kind, convert in ((int, int), (float, float), (bool, string_to_bool)):
            if kind in kinds:
                try:
                    return convert(value)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    pass
    return value


def _check_schedule(config: TrainConfig) -> None:
    """Delinks happen in order, within the pseudo stage, and each keeps the function (see `delink_sources`)."""
    m, t = config.model, config.train
    depth = m.num_hidden_layers
    if t.pseudo_steps == 0:
        # A real model from scratch: the pseudo stage's shape (num_unique_layers, partial_delink_blocks) is unused,
        # but steps given for its delinks cannot be taken.
        if t.partial_delink_steps:
            raise ConfigError(
                "partial_delink_steps: partial delinks need a pseudo stage (pseudo_steps > 0); clear them with "
                "--partial_delink_steps none"
            )
        return
    if not m.num_unique_layers < depth:
        raise ConfigError(
            f"num_unique_layers: the pseudo model needs fewer blocks than layers ({depth}), got {m.num_unique_layers}"
        )
    count = len(t.partial_delink_blocks)
    if t.partial_delink_steps and len(t.partial_delink_steps) != count:
        raise ConfigError(
            f"partial_delink_blocks: one entry per partial_delink_steps entry ({len(t.partial_delink_steps)}), "
            f"got {count}"
        )
    if count >= t.pseudo_steps:
        raise ConfigError(
            f"partial_delink_blocks: {count} partial delinks need a pseudo stage of more than {count} steps, got "
            f"pseudo_steps={t.pseudo_steps}; give fewer partial_delink_blocks (--partial_delink_blocks none clears "
            "them) or more pseudo_steps"
        )
    previous = 0
    for step in t.partial_delink_steps:
        if not previous < step < t.pseudo_steps:
            raise ConfigError(
                f"partial_delink_steps: steps must increase and lie in (0, pseudo_steps={t.pseudo_steps}), got "
                f"{_short(t.partial_delink_steps)}; leave it out (--partial_delink_steps none) for evenly spaced steps "
                f"({_short(even_delink_steps(t.pseudo_steps, count))}) or give steps in that range"
            )
        previous = step
    blocks = m.num_unique_layers
    for new_blocks in t.partial_delink_blocks:
        # The final delink (to L blocks) is always valid once every partial stage keeps fewer than L blocks.
        if new_blocks >= depth:
            raise ConfigError(
                f"partial_delink_blocks: a partial delink keeps fewer blocks than layers ({depth}), got {new_blocks}"
            )
        try:
            delink_sources(depth, blocks, new_blocks, m.sharing_pattern)
        except ValueError as error:
            raise ConfigError(f"partial_delink_blocks: {error}") from None
        blocks = new_blocks


def _check_offload(config: TrainConfig) -> None:
    """Block indices name blocks of the first model: every later one (more blocks) has them too."""
    indices = config.train.offload_spec
    first = config.initial_blocks()
    if isinstance(indices, list) and any(not 0 <= index < first for index in indices):
        stages = " -> ".join(map(str, [first, *(blocks for _, blocks in config.delink_schedule())]))
        raise ConfigError(
            f"offload: block indices {_short(indices)} must exist in every model of the run ({stages} blocks: the "
            f"first has blocks 0..{first - 1}); give a ratio of the blocks (0.5) or auto, which choose again after "
            "each delink"
        )


def check_types(instance) -> None:
    """Raise `ConfigError("field: ...")` where a value does not match its annotation.

    Needed because HfArgumentParser never checks `Literal` choices given as defaults, and the dataclasses are also
    built in code (YAML values are checked, naming the file, before they become defaults: `_read_yaml`).
    """
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if not _matches(value, hints[f.name]):
            raise ConfigError(f"{f.name}: expected {_describe(hints[f.name])}, got {_short(value)}")


def check_range(name: str, value, low=None, high=None, strict_low=False, strict_high=False) -> None:
    """Raise `ConfigError("name: ...")` unless low <= value <= high (None passes: the field's default applies)."""
    if value is None:
        return
    too_low = low is not None and (value <= low if strict_low else value < low)
    too_high = high is not None and (value >= high if strict_high else value > high)
    if too_low or too_high:
        lower = f"{low} <{'' if strict_low else '='} " if low is not None else ""
        upper = f" <{'' if strict_high else '='} {high}" if high is not None else ""
        raise ConfigError(f"{name}: must satisfy {lower}{name}{upper}, got {_short(value)}")


def _matches(value, annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an integer past the largest float
            return False
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is list:
        return f"a list ({_describe(args[0])} each)"
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(annotation, annotation.__name__)


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 8, 8, 80, 40, 80


def _short(value: Any) -> str:
    """`repr(value)` for a one-line message: bounded in length and depth, whatever a file or flag held."""
    return _one_line(_REPR.repr(value), limit=200)


def _one_line(text: str, limit: int = 400) -> str:
    """`text` on one printable line of at most `limit` characters (control characters escaped)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
