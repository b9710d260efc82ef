"""Bytes per GPU of a P2R model under a parallel layout, counted from the model's inventory (its tensors, from its
config: `hf_p2r.models.p2r.inventory_p2r`, which tests hold equal to the model built on the meta device).

Model states (weights, gradients, optimizer state) are summed tensor by tensor over the parameters a GPU holds:
the model's own tensor-parallel plan (`tp_plan`: what transformers assembles as `model.tp_plan`, from the config's
`base_model_tp_plan` and the causal LM class's head plan) says which dimension TP splits, FSDP2 / ZeRO-3 split
dimension 0 in `dp` chunks (FSDP2's layout; rank 0 holds the largest chunk), and a pipeline stage holds the blocks its
depths run. A pseudo model stores k blocks, so its model
states are about k/L of the real model's; its activations are the real model's (it computes all L depths).

Activations follow the tensors autograd saves in `P2RDecoderLayer` with SDPA attention (no L x L score matrix),
counted in `layer_activation_bytes`; the unit test checks the count against `saved_tensors_hooks` byte for byte.
"""

import math
import re
from dataclasses import dataclass

from ..compat import causal_lm_tp_plan
from ..distributed.offload.estimates import offload_working_set_bytes
from ..distributed.pipeline.schedules import SCHEDULES, get_schedule
from ..distributed.pipeline.split import balanced_split, stage_depths
from ..models.p2r import P2RConfig, P2RMoeConfig
from ..models.p2r.inventory_p2r import inventory
from .assumptions import PRECISIONS, GiB, Precision

# Where TP splits a weight, by the style names of transformers' `ALL_PARALLEL_STYLES`; other styles replicate.
_TP_DIM = {
    "colwise": 0,
    "colwise_rep": 0,
    "colwise_gather_output": 0,
    "packed_colwise": 0,
    "embedding_rowwise": 0,
    "rowwise": -1,
    "rowwise_rep": -1,
    "rowwise_split_input": -1,
    "packed_rowwise": -1,
    "embedding_colwise": 1,
}


@dataclass(frozen=True)
class ParameterTensor:
    """One parameter tensor as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    block: int | None  # stored block index for `model.layers.{b}.*`, None for embeddings, final norm and head
    tp_dim: int | None  # dimension the TP plan splits; None when every TP rank holds all of it
    routed: float = 1.0  # share of it one token computes with (an expert's: top-k of the experts), the inventory's

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def active_numel(self) -> float:
        """Elements one token computes with: FLOPs follow this, memory follows `numel`."""
        return self.numel * self.routed

    @property
    def is_embedding(self) -> bool:
        return self.name.endswith("embed_tokens.weight")

    def tp_shape(self, tp: int) -> tuple[int, ...]:
        """Shape on one TP rank (the largest chunk when the dimension does not divide)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] = -(-shape[self.tp_dim] // tp)
        return tuple(shape)


def tp_plan(config: P2RConfig) -> dict[str, str]:
    """The tensor-parallel plan of `AutoModelForCausalLM.from_config(config)` (its `model.tp_plan`), without building
    the model: as transformers assembles it (`init_parallel_plans`), the causal LM class's own plan (the head), then
    the base model's (`model.`: the embeddings on the vocabulary, and the config's `base_model_tp_plan`). The class is
    the Auto registry's for the config's type. tests/planning/test_memory.py holds it equal to the built model's."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    head = causal_lm_tp_plan(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    base = {"embed_tokens": "embedding_rowwise", **(config.base_model_tp_plan or {})}
    return {**head, **{f"model.{name}": style for name, style in base.items()}}


def parameter_tensors(config: P2RConfig) -> list[ParameterTensor]:
    """Every parameter of the causal LM of `config` (tied ones once), in `named_parameters()` order, from its
    inventory, with the dimension its TP plan splits: nothing built, nothing allocated."""
    plan = tp_plan(config)
    tensors = []
    for piece in inventory(config).pieces:
        for tensor in piece.tensors:
            module_name, _, leaf = tensor.name.rpartition(".")
            tp_dim = _TP_DIM.get(plan.get(re.sub(r"\.\d+\.", ".*.", module_name)))
            if tp_dim is not None and leaf == "bias" and tp_dim == -1:
                tp_dim = None  # a row-wise layer's bias is added after the reduction: replicated
            if tp_dim is not None and tp_dim < 0:
                tp_dim += len(tensor.shape)
            tensors.append(ParameterTensor(tensor.name, tensor.shape, piece.block, tp_dim, tensor.routed))
    return tensors


def dp_shard_numel(shape: tuple[int, ...], dp: int) -> int:
    """Elements of the largest FSDP2 / ZeRO-3 shard of a tensor: dimension 0 cut in `dp` chunks."""
    if not shape:
        return 1
    return -(-shape[0] // dp) * math.prod(shape[1:])


@dataclass(frozen=True)
class Layout:
    """How one model is spread over `dp * tp * pp` GPUs, and what else saves memory.

    `zero`: 0 = DDP (everything replicated), 1 = optimizer state sharded over DP (ZeRO-1, Megatron's distributed
    optimizer), 2 = + gradients (ZeRO-2), 3 = + weights (ZeRO-3 / FSDP2). `offload`: fraction of the blocks whose
    model states live in CPU memory (granular offload; 1.0 also moves embeddings and head, as FSDP2's
    `CPUOffloadPolicy` does). `recompute`: activation checkpointing of every decoder layer. `schedule`: the pipeline
    schedule when `pp > 1` (`PIPELINE_SCHEDULES`: the trainer's `pipeline_schedule` values, the schedule registry's).
    """

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    offload: float = 0.0
    recompute: bool = False
    schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def offloads_everything(self) -> bool:
        return self.zero == 3 and self.offload >= 1

    @property
    def sharding(self) -> str:
        return ("ddp", "zero1", "zero2", "fsdp2/zero3")[self.zero]


# The pipeline schedules the planner sizes: every `pipeline_schedule` the trainer offers, with each one's facts (weight
# versions, the micro-batches it needs, its bubble, the activations a stage holds) from the schedule registry.
PIPELINE_SCHEDULES = SCHEDULES
# Stages per process under an interleaved schedule: what the trainer runs (`build_pipeline`'s `virtual_stages`).
VIRTUAL_STAGES = 2


@dataclass(frozen=True)
class Stage:
    """One process of a pipeline: the depths it runs (those of each of its stages: several under an interleaved
    schedule), the stored blocks they use, and its share of the other tensors."""

    depths: tuple[int, ...]
    blocks: tuple[int, ...]
    first: bool  # holds the embeddings (the pipeline's first stage)
    last: bool  # holds the head (the pipeline's last stage)
    parts: tuple[tuple[int, range], ...] = ()  # (the stage's index in the pipeline, its depths), one per stage


def pipeline_stages(config: P2RConfig, pp: int, seq_len: int | None = None, schedule: str = "1f1b") -> list[Stage]:
    """The `pp` processes of a pipeline of `config`: with `seq_len`, the split the trainer runs (`balanced_split`:
    layers per stage balancing each stage's training FLOPs for `seq_len`-token sequences, then its bytes; never inside
    a block of a `sequence` pseudo model) into `pp` stages, or `pp * VIRTUAL_STAGES` under an interleaved `schedule`,
    stage s on process s mod pp; `ValueError` (the trainer's) where it has no such split. Without `seq_len`, equal
    numbers of depths per stage (`pp` must divide the depth).

    A process holds every stored block its depths run: for a `"sequence"` pseudo model each block lands on one stage;
    for a `"cycle"` pseudo model every stage holds all the blocks its depths cycle through (a copy per stage).
    """
    depth = config.num_hidden_layers
    if seq_len is None:
        if depth % pp:
            raise ValueError(f"pp={pp} must divide num_hidden_layers ({depth})")
        split = [depth // pp] * pp
    else:
        num_stages = pp * get_schedule(schedule).stages_per_process(VIRTUAL_STAGES) if pp > 1 else 1
        split = balanced_split(config, num_stages, seq_len) if num_stages > 1 else [depth]
    order = config.block_of_depth
    parts = list(enumerate(stage_depths(split)))
    stages = []
    for process in range(pp):
        mine = tuple(parts[process::pp])
        depths = tuple(d for _, stage in mine for d in stage)
        blocks = tuple(sorted({order[d] for d in depths}))
        stages.append(Stage(depths, blocks, first=process == 0, last=mine[-1][0] == len(split) - 1, parts=mine))
    return stages


def stage_tensors(tensors: list[ParameterTensor], stage: Stage, tied: bool) -> list[ParameterTensor]:
    """The parameters a stage holds. With tied embeddings the last stage keeps its own copy of the embedding to
    compute the logits (as Megatron does)."""
    blocks = set(stage.blocks)
    held = []
    for tensor in tensors:
        if tensor.block is not None:
            if tensor.block in blocks:
                held.append(tensor)
        elif tensor.is_embedding:
            if stage.first or (tied and stage.last):
                held.append(tensor)
        elif stage.last:
            held.append(tensor)
    return held


@dataclass
class Memory:
    """Bytes on one GPU (and the CPU memory it uses for offload)."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0  # unsharded FSDP units in flight, offload staging
    cpu: int = 0

    @property
    def model_states(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers


def model_state_bytes(
    tensors: list[ParameterTensor],
    layout: Layout,
    precision: Precision,
    offload_blocks: set[int] = frozenset(),
    optimizer: str = "adamw",
) -> Memory:
    """Weights, gradients and optimizer state on one GPU holding `tensors` (one stage), by tensor.

    Tensors of the blocks in `offload_blocks` (every tensor when `layout.offloads_everything`) count as CPU memory.
    `optimizer`: the trainer's (`adamw`, or `muon`: one momentum buffer per element of a block's matrix and no step
    counter, `is_muon_matrix`; AdamW's two moments for the rest).
    """
    memory = Memory()
    for tensor in tensors:
        numel = math.prod(tensor.tp_shape(layout.tp))
        shard = dp_shard_numel(tensor.tp_shape(layout.tp), layout.dp)
        weights = precision.weight * (shard if layout.zero >= 3 else numel)
        grads = precision.grad * (shard if layout.zero >= 2 else numel)
        per_element, per_tensor = precision.optimizer, precision.optimizer_per_tensor
        if optimizer == "muon" and is_muon_matrix(tensor):
            per_element, per_tensor = precision.optimizer - precision.moment, 0
        optimizer_bytes = per_element * (shard if layout.zero >= 1 else numel) + per_tensor
        if layout.offloads_everything or tensor.block in offload_blocks:
            memory.cpu += weights + grads + optimizer_bytes
        else:
            memory.weights += weights
            memory.grads += grads
            memory.optimizer += optimizer_bytes
    return memory


def is_muon_matrix(tensor: ParameterTensor) -> bool:
    """Whether `optimizer: muon` steps `tensor` with Muon (`hf_p2r.training.optim.muon_parameters`: a block's matrix,
    or an MoE block's 3-D experts)."""
    return tensor.block is not None and len(tensor.shape) >= 2


def layer_activation_bytes(config: P2RConfig, tokens: int, tp: int, precision: Precision) -> int:
    """Bytes autograd saves in one decoder layer for `tokens` tokens (SDPA attention, no recompute).

    Each RMSNorm saves its input in fp32 (upcast) and its per-token inverse RMS (fp32), the normalized tensor and
    its output (the next linear layer's input), all replicated over TP ranks. Split over TP: queries, keys and
    values after RoPE, the attention output, the MLP's gate, up, SiLU and product tensors (4 x intermediate), and
    the attention's log-sum-exp (fp32, one per head).
    """
    a = precision.activation
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    norms = 2 * (4 * hidden + 4 + 2 * a * hidden)
    mlp = 4 * config.intermediate_size
    if isinstance(config, P2RMoeConfig):
        # A sparse layer: each of a token's k experts saves its input copy and its 4 intermediate tensors; the router
        # its logits (fp32). The larger of a sparse and a dense layer (when there is one) is counted for every layer.
        sparse = config.num_experts_per_tok * (hidden + 4 * config.moe_intermediate_size) + 4 * config.num_experts // a
        mlp = max(sparse, mlp if not all(config.sparse_depths) else 0)
    split = a * (2 * q + 2 * kv + mlp) + 4 * heads
    return tokens * (norms + split // tp)


def head_activation_bytes(config: P2RConfig, tokens: int, precision: Precision) -> int:
    """Final norm, the fp32 log-softmax the loss saves, and the label ids (last pipeline stage)."""
    hidden = config.hidden_size
    return tokens * ((4 * hidden + 4 + 2 * precision.activation * hidden) + 4 * config.vocab_size + 8)


def logits_bytes(config: P2RConfig, tokens: int, precision: Precision) -> int:
    """The logits the forward returns (live until the step ends; every TP rank holds them gathered)."""
    return tokens * config.vocab_size * precision.activation


def saved_activation_bytes(
    config: P2RConfig, batch: int, seq_len: int, precision: Precision, tp: int = 1, recompute: bool = False
) -> int:
    """Bytes autograd saves in one forward of the whole model with labels (SDPA, no pipeline), the quantity the unit
    test measures: the input ids, the rotary tables (kept by the layers' saved tensors; not with recompute, where a
    checkpointed layer keeps only its input hidden states), every depth, the head and the loss's fp32 normalizer."""
    tokens = batch * seq_len
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if recompute:
        layers = tokens * precision.activation * config.hidden_size
        rotary = 0
    else:
        layers = layer_activation_bytes(config, tokens, tp, precision)
        rotary = 2 * precision.activation * seq_len * head_dim
    return (
        8 * tokens + rotary + config.num_hidden_layers * layers + head_activation_bytes(config, tokens, precision) + 4
    )


__all__ = [
    "GiB",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "Layout",
    "Memory",
    "ParameterTensor",
    "Precision",
    "Stage",
    "VIRTUAL_STAGES",
    "dp_shard_numel",
    "head_activation_bytes",
    "is_muon_matrix",
    "layer_activation_bytes",
    "logits_bytes",
    "model_state_bytes",
    "parameter_tensors",
    "pipeline_stages",
    "saved_activation_bytes",
    "offload_working_set_bytes",
    "stage_tensors",
]


# Host memory of one process of a CPU run (gloo, fp32, AdamW) of the trainer's pipeline engine, above what the same
# layout's run of a tiny model holds (Python, torch, gloo, the corpus: about 0.5 GiB). Measured by
# scripts/bench_scale.py (benchmarks/scale.md), which prints this figure beside each measurement and its margin.
HOST_STATE_BYTES_PER_PARAMETER = 16  # fp32 weights and gradients, AdamW's two moments
HOST_TEMPORARY_BYTES_PER_PARAMETER = 4  # AdamW's foreach step: one fp32 temporary of the parameters a process steps
# FSDP2's backward: the running block's fp32 weights and gradient whole, and the next block's weights prefetched.
HOST_GATHERED_BYTES_PER_BLOCK_PARAMETER = 12


@dataclass(frozen=True)
class HostMemory:
    """Bytes one process's peak resident size rises above a tiny model's run of the same layout (see
    `host_memory_per_process`)."""

    state: int  # its share of the training state
    gathered: int  # weights and gradients held whole for a while: FSDP2's running block and the one it prefetches
    temporary: int  # the optimizer step's temporaries

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.temporary


def host_memory_per_process(
    parameters: int, processes: int, *, stages: int = 1, sharded: bool = True, block_parameters: int = 0
) -> HostMemory:
    """The per-process host memory of a CPU run of a model of `parameters` (the real model's: the pseudo model's are
    fewer) over `processes` processes in `stages` pipeline stages, each stage sharded (FSDP2, `data_parallel_shard:
    true`) or replicated over its `processes / stages` data-parallel copies; `block_parameters`: the largest block's.

    - state: 16 bytes per parameter the process holds: 1 / `processes` of the model when sharded, else its stage's;
    - gathered: FSDP2 gathers a block at a time, the whole model as one stage or a pipeline's sharded stages alike
      (each micro-batch's backward reshards and reduce-scatters: `ShardedPipelineStage`); in the backward the running
      block's weights and gradient are whole and the next block's weights prefetched: 12 bytes per parameter of the
      largest block;
    - temporary: AdamW's step (foreach) makes an fp32 temporary of the parameters the process steps, 4 bytes each.

    >>> memory = host_memory_per_process(164_000_000, 8, stages=2, block_parameters=13_600_000)  # 2 stages x 4 sharded
    >>> memory.state, memory.gathered, memory.temporary
    (328000000, 163200000, 82000000)
    """
    if processes % stages:
        raise ValueError(f"processes: {processes} is not a multiple of the {stages} pipeline stages")
    held = parameters / processes if sharded else parameters / stages
    gathered = 0 if not sharded or processes == stages else HOST_GATHERED_BYTES_PER_BLOCK_PARAMETER * block_parameters
    return HostMemory(
        state=math.ceil(HOST_STATE_BYTES_PER_PARAMETER * held),
        gathered=math.ceil(gathered),
        temporary=math.ceil(HOST_TEMPORARY_BYTES_PER_PARAMETER * held),
    )


def real_parameters(config: P2RConfig) -> int:
    """Parameters of `config`'s model, counted from its inventory (nothing allocated)."""
    return sum(tensor.numel for tensor in parameter_tensors(config))


def block_parameters(tensors: list[ParameterTensor]) -> int:
    """Parameters of the largest stored block among `tensors` (`parameter_tensors(config)`)."""
    per_block: dict[int, int] = {}
    for tensor in tensors:
        if tensor.block is not None:
            per_block[tensor.block] = per_block.get(tensor.block, 0) + tensor.numel
    return max(per_block.values(), default=0)
