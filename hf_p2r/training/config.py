"""Training configuration: three dataclasses read from a YAML file, then overridden from the command line.

```bash
accelerate launch scripts/train.py --config configs/demo.yaml --pseudo_steps 50 --optimizer_carry copy
```

Keys are flat (as in transformers' `run_clm.py`): every field of `ModelArguments`, `DataArguments` and
`TrainArguments` is both a YAML key and a `--flag`. Every bad value raises `ValueError("field: problem")`.
"""

import argparse
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from huggingface_hub.errors import StrictDataclassError
from transformers import HfArgumentParser

from ..errors import InputError
from ..models.p2r import P2RConfig, P2RMoeConfig, delink_sources


class ConfigError(InputError):
    """A bad configuration (exit code 2 from the trainer's command line), wherever it is found: while parsing, or at
    run time for what only the run can check (e.g. `offload: auto` with no device memory to plan for)."""


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
    num_unique_layers: int = field(default=1, metadata={"help": "k, the distinct blocks of the pseudo model."})
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
            raise ValueError(
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
        metadata={"help": "Local .txt/.md/.py (one document per file) or .json/.jsonl files, or folders of them."},
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text (JSON and Hub datasets)."})
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
            raise ValueError("train_files: give either dataset_name (Hub) or train_files (local), not both")


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
        default_factory=list, metadata={"help": "Steps (< pseudo_steps) of partial delinks, e.g. 50 (1 -> k -> L)."}
    )
    partial_delink_blocks: list[int] = field(
        default_factory=list, metadata={"help": "Blocks after each partial delink, e.g. 4."}
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
    warmup_steps: int = field(default=20, metadata={"help": "Linear warm-up at the start of the run."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final learning rate / peak (cosine, linear, wsd)."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices and embeddings only)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (0: off)."})
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None, metadata={"help": "Default: what `accelerate config` / `accelerate launch` says."}
    )
    cpu: bool | None = field(
        default=None, metadata={"help": "Train on CPU (gloo for several processes). Default: when no accelerator."}
    )
    logging_steps: int = field(default=10, metadata={"help": "Write a metrics.jsonl record every N steps."})
    eval_steps: int = field(default=50, metadata={"help": "Validation loss every N steps (0: only at the end)."})
    eval_blocks: int = field(default=64, metadata={"help": "Validation blocks per evaluation, spread over the split."})
    save_steps: int = field(default=0, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep the newest N checkpoints (None: all)."})
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none, tensorboard, wandb, all."})
    remote_code: bool = field(
        default=True, metadata={"help": "Save the modeling code with pseudo/ and real/ (trust_remote_code)."}
    )
    offload: str | None = field(
        default=None,
        metadata={
            "help": "Granular CPU offload of blocks (one process): auto, a ratio of blocks (0.5) or block indices "
            "([1, 3, 5]); re-selected after every delink, so auto offloads nothing while the pseudo model fits."
        },
    )
    offload_budget_gb: float | None = field(
        default=None, metadata={"help": "Device memory offload: auto plans for (default on CUDA: 85%% of it)."}
    )
    offload_prefetch: int = field(default=1, metadata={"help": "Offloaded blocks copied ahead of their use."})
    pipeline_parallel_size: int = field(
        default=1,
        metadata={"help": "Pipeline stages (processes) the model is split into by depth (hf_p2r.distributed)."},
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "2bw"] = field(
        default="1f1b",
        metadata={"help": "Pipeline schedule: torch's gpipe, 1f1b, interleaved_1f1b, zero_bubble, or PipeDream-2BW."},
    )
    num_microbatches: int | None = field(
        default=None,
        metadata={"help": "Micro-batches per optimizer step in a pipeline (default: pipeline_parallel_size)."},
    )
    pipeline_split: list[int] | None = field(
        default=None, metadata={"help": "Layers per stage, e.g. [3, 5] (default: balanced from FLOPs and bytes)."}
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Data-parallel pipelines beside pipeline_parallel_size (a 2-D mesh of data_parallel_size x "
            "pipeline_parallel_size processes); each reads per_device_batch_size blocks per step."
        },
    )
    data_parallel_shard: bool = field(
        default=False,
        metadata={
            "help": "Shard each pipeline stage with FSDP2 over the data-parallel pipelines (weights, gradients and "
            "optimizer state split data_parallel_size ways); default: replicated stages that average gradients."
        },
    )

    def __post_init__(self):
        # YAML gives a number or a list; the command line a string. Keep one canonical string form.
        if isinstance(self.offload, int | float | list) and not isinstance(self.offload, bool):
            self.offload = str(self.offload)
        check_types(self)
        if parse_offload(self.offload) is None:  # "none" is no offload, like leaving it out
            self.offload = None
        check_range("offload_budget_gb", self.offload_budget_gb, low=0.0, strict_low=True)
        check_range("offload_prefetch", self.offload_prefetch, low=0)
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
        check_range("max_grad_norm", self.max_grad_norm, low=0.0)
        if self.pseudo_steps + self.real_steps == 0:
            raise ValueError("real_steps: pseudo_steps + real_steps must be at least 1")
        check_range("pipeline_parallel_size", self.pipeline_parallel_size, low=1)
        check_range("num_microbatches", self.num_microbatches, low=1)
        check_range("data_parallel_size", self.data_parallel_size, low=1)
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        elif self.data_parallel_size != 1 or self.data_parallel_shard:
            name = "data_parallel_size" if self.data_parallel_size != 1 else "data_parallel_shard"
            raise ValueError(
                f"{name}: applies to pipelined runs (pipeline_parallel_size > 1); without a pipeline, data parallelism "
                "is the launcher's process count (accelerate launch --num_processes N, with FSDP2 or DeepSpeed)"
            )
        if self.lr_scheduler == "wsd" and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"lr_decay_fraction: warm-up ({self.warmup_steps} steps) and decay ({self.decay_steps}) must fit in "
                f"the run ({self.total_steps} steps), got {self.lr_decay_fraction}"
            )

    def _check_pipeline(self) -> None:
        """Refuse, in one line naming the fields, what a pipelined run does not support."""
        refused = [
            (
                "data_parallel_shard",
                self.data_parallel_shard and self.pipeline_schedule == "2bw",
                "PipeDream-2BW swaps two weight versions, which FSDP2's sharded parameters do not allow",
            ),
            ("offload", self.offload is not None, "granular offload runs in one process"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps != 1, "num_microbatches splits the batch"),
            ("mixed_precision", self.mixed_precision not in (None, "no"), "stages run in fp32 so far"),
        ]
        for name, bad, why in refused:
            if bad:
                raise ValueError(f"{name}: not supported with pipeline_parallel_size > 1 ({why})")
        if self.data_parallel_shard and self.data_parallel_size == 1:
            raise ValueError("data_parallel_shard: shards a stage over data_parallel_size > 1 pipelines, got 1")
        microbatches = self.num_microbatches or self.pipeline_parallel_size
        if self.per_device_batch_size % microbatches:
            raise ValueError(
                f"num_microbatches: {microbatches} must divide per_device_batch_size ({self.per_device_batch_size}), "
                "the pipeline's batch"
            )
        if self.pipeline_schedule == "2bw" and microbatches < self.pipeline_parallel_size:
            raise ValueError(
                f"num_microbatches: PipeDream-2BW needs at least pipeline_parallel_size ({self.pipeline_parallel_size})"
                f" micro-batches per step, got {microbatches}"
            )

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


def parse_offload(text: str | None) -> str | float | list[int] | None:
    """ "auto" | "0.5" | "[1, 3, 5]" | None -> "auto" | 0.5 | [1, 3, 5] | None; `ValueError("offload: ...")` else."""
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
    except (ValueError, yaml.YAMLError):
        pass
    raise ValueError(
        f"offload: expected auto, a ratio between 0 and 1 (0.5) or a list of block indices ([1, 3, 5]), got {text!r}"
    )


@dataclass
class TrainConfig:
    """The whole run: `config.model`, `config.data`, `config.train`."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments

    def to_dict(self) -> dict[str, Any]:
        """Flat {field: value}, the YAML layout (recorded in every checkpoint and given to trackers)."""
        return {**dataclasses.asdict(self.model), **dataclasses.asdict(self.data), **dataclasses.asdict(self.train)}

    def delink_schedule(self) -> list[tuple[int, int]]:
        """[(step, blocks after the delink at that step)], ending with (pseudo_steps, L); empty for a scratch run."""
        if self.train.pseudo_steps == 0:
            return []
        stages = list(zip(self.train.partial_delink_steps, self.train.partial_delink_blocks))
        return [*stages, (self.train.pseudo_steps, self.model.num_hidden_layers)]

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
        except StrictDataclassError as error:
            # huggingface_hub wraps the validator's message in context lines: keep the message of the last one.
            message = str(error).strip().splitlines()[-1].strip()
            raise ValueError(f"model: {re.sub(r'^[A-Za-z]+Error: ', '', message)}") from None


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """`--config FILE` (YAML, flat keys) plus `--field value` overrides -> `TrainConfig`.

    Raises `ValueError` naming the field (or the unknown key / bad flag) for any bad input.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    parser = _Parser(
        (ModelArguments, DataArguments, TrainArguments),
        prog="train.py",
        usage="%(prog)s [--config FILE] [--FIELD VALUE ...]",
        description="P2R pretraining: pseudo stage -> delink -> real stage. Every --FIELD is also a YAML key.",
    )
    parser.add_argument("--config", help="YAML file of FIELD: VALUE lines; flags on the command line override it.")
    if known.config is not None:
        parser.set_defaults(**_read_yaml(Path(known.config), parser))
    # Values set by set_defaults skip argparse's `type` unless they are strings, hence the checks in __post_init__.
    model, data, train, _, unknown = parser.parse_args_into_dataclasses(
        rest, return_remaining_strings=True, look_for_args_file=False
    )
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (see --help for the fields)")
    config = TrainConfig(model, data, train)
    _check_schedule(config)
    # Shape errors (e.g. heads not dividing the width) now rather than after the data is tokenized.
    config.p2r_config(vocab_size=model.vocab_size or 256, num_blocks=config.initial_blocks(), special_tokens={})
    return config


class _Parser(HfArgumentParser):
    def error(self, message: str):
        # argparse prints the whole usage and exits; we want one line from the caller.
        raise ValueError(message)


def _read_yaml(path: Path, parser: HfArgumentParser) -> dict[str, Any]:
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"config: cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config: {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"config: {path} must hold FIELD: VALUE lines, got a {type(values).__name__}")
    known = {action.dest for action in parser._actions} - {"help", "config"}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"config: {path}: unknown key {key!r}{hint}")
    return values


def _check_schedule(config: TrainConfig) -> None:
    """Delinks happen in order, within the pseudo stage, and each keeps the function (see `delink_sources`)."""
    m, t = config.model, config.train
    depth = m.num_hidden_layers
    if t.pseudo_steps == 0:
        if t.partial_delink_steps or t.partial_delink_blocks:
            raise ValueError("partial_delink_steps: partial delinks need a pseudo stage (pseudo_steps > 0)")
        return
    if not m.num_unique_layers < depth:
        raise ValueError(
            f"num_unique_layers: the pseudo model needs fewer blocks than layers ({depth}), got {m.num_unique_layers}"
        )
    if len(t.partial_delink_steps) != len(t.partial_delink_blocks):
        raise ValueError(
            f"partial_delink_blocks: one entry per partial_delink_steps entry ({len(t.partial_delink_steps)}), "
            f"got {len(t.partial_delink_blocks)}"
        )
    previous = 0
    for step in t.partial_delink_steps:
        if not previous < step < t.pseudo_steps:
            raise ValueError(
                f"partial_delink_steps: steps must increase and lie in (0, pseudo_steps={t.pseudo_steps}), got "
                f"{t.partial_delink_steps}"
            )
        previous = step
    blocks = m.num_unique_layers
    for new_blocks in t.partial_delink_blocks:
        # The final delink (to L blocks) is always valid once every partial stage keeps fewer than L blocks.
        if new_blocks >= depth:
            raise ValueError(
                f"partial_delink_blocks: a partial delink keeps fewer blocks than layers ({depth}), got {new_blocks}"
            )
        try:
            delink_sources(depth, blocks, new_blocks, m.sharing_pattern)
        except ValueError as error:
            raise ValueError(f"partial_delink_blocks: {error}") from None
        blocks = new_blocks


def check_types(instance) -> None:
    """Raise `ValueError("field: ...")` where a value does not match its annotation.

    Needed because HfArgumentParser's `set_defaults` path (YAML values) skips argparse's type conversion for
    non-strings and never checks `Literal` choices.
    """
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if not _matches(value, hints[f.name]):
            raise ValueError(f"{f.name}: expected {_describe(hints[f.name])}, got {value!r}")


def check_range(name: str, value, low=None, high=None, strict_low=False, strict_high=False) -> None:
    """Raise `ValueError("name: ...")` unless low <= value <= high (None passes: the field's default applies)."""
    if value is None:
        return
    too_low = low is not None and (value <= low if strict_low else value < low)
    too_high = high is not None and (value >= high if strict_high else value > high)
    if too_low or too_high:
        lower = f"{low} <{'' if strict_low else '='} " if low is not None else ""
        upper = f" <{'' if strict_high else '='} {high}" if high is not None else ""
        raise ValueError(f"{name}: must satisfy {lower}{name}{upper}, got {value!r}")


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
        return isinstance(value, int | float) and not isinstance(value, bool)
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
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(annotation, annotation.__name__)
