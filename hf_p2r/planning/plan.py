"""`plan`: which parallel layouts fit a P2R model on N GPUs, best first by estimated step time.

The layout space follows the Frontier study (arXiv 2312.12705), which trained 22B-1T models by combining sharded
data parallelism, tensor parallelism within a node and pipeline parallelism: DP with ZeRO stage 0-3 (FSDP2 is
ZeRO-3), TP degrees that divide a node, PP degrees that divide the depth, granular CPU offload and activation
recomputation. Like PipeDream-2BW's planner (arXiv 2006.09503), it exploits the repeated transformer layers,
discards the configurations that exceed the memory capacity, and ranks the others with a cost model. A pipeline is
sized as the trainer runs it: every schedule of the schedule registry (`hf_p2r.distributed.pipeline.schedules`:
weight versions, the micro-batches it needs, its bubble, the activations a stage holds), split by the trainer's own
`balanced_split` (stages of balanced training FLOPs, never inside a block of a `sequence` pseudo model;
`VIRTUAL_STAGES` stages per process under an interleaved schedule).

Cost model (every assumption is a field of `Hardware`, overridable from the command line):
- compute: the model inventory's training FLOPs per token (`hf_p2r.models.p2r.inventory_p2r`: 6 per matmul weight
  element a token uses, of the *real* depth, since a pseudo model computes all L depths, plus 12 L q s for attention
  scores, PaLM's count; a third more of the layers' with recomputation), at `mfu * peak_flops`, stretched by the
  pipeline bubble the schedule has: divided by 1 - (pp - 1) / (m + pp - 1) for m micro-batches per pipeline under a
  schedule flushed every step, by 1 under PipeDream-2BW (no flush: no bubble in steady state);
  `hf_p2r.distributed.simulate` replays the schedules themselves (`stage_seconds` gives it the stage times);
- memory of a pipeline process follows its schedule: GPipe holds the activations of all m micro-batches, the others
  those of at most d - s on stage s of d, and 2BW two versions of the stage's weights;
- communication: ring collectives move 2 (n-1)/n of a buffer for an all-reduce and (n-1)/n for a reduce-scatter
  or all-gather; a group inside a node uses `intra_node_bandwidth`, one that spans nodes `inter_node_bandwidth`
  (ranks are placed TP innermost, then DP, then PP, as in Megatron);
- offload: weights host-to-device for every use, gradients device-to-host, at `pcie_bandwidth`, and the CPU
  optimizer step at `cpu_adam_params_per_second` shared by a node's GPUs; granular offload (one GPU) counts what the
  step-time model of `hf_p2r.distributed.offload.step_time` says is exposed beside the compute (the trainer's design);
- nothing else overlaps: the step time is the sum (an upper bound, the same for every layout).
"""

import copy
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from ..checkpoint.io import CONFIG_NAME, read_config_dict
from ..checkpoint.source import read_p2r_config_dict
from ..distributed.offload.step_time import Design, HostRates, OffloadStep, predict_step_seconds
from ..distributed.pipeline.schedules import get_schedule
from ..distributed.pipeline.split import allowed_cuts
from ..errors import InputError, read_json
from ..models.p2r import P2RConfig, P2RMoeConfig
from ..models.p2r.inventory_p2r import Inventory, inventory
from ..models.p2r.sharing_p2r import validate_layout, validate_moe
from .assumptions import MAX_BATCH, MAX_GPUS, MAX_SEQ_LEN, OPTIMIZERS, Hardware, check_int
from .memory import (
    PIPELINE_SCHEDULES,
    VIRTUAL_STAGES,
    Layout,
    Memory,
    ParameterTensor,
    Precision,
    Stage,
    head_activation_bytes,
    layer_activation_bytes,
    logits_bytes,
    model_state_bytes,
    offload_working_set_bytes,
    parameter_tensors,
    pipeline_stages,
    stage_tensors,
)

OFFLOAD_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)  # granular offload: share of the stored blocks in CPU memory
# The longest search (stages x allowed cuts^2 steps of `balanced_split`'s dynamic program) the planner runs to size one
# pipeline shape the way the trainer splits it: about a second. Deeper pipelines of very deep models are left out.
MAX_SPLIT_STEPS = 2_000_000


@dataclass(frozen=True)
class Workload:
    """One optimizer step: `global_batch` sequences of `seq_len` tokens, `micro_batch` per GPU per forward, under the
    trainer's `optimizer` (adamw, or muon: one state buffer per element of the blocks' matrices)."""

    seq_len: int
    micro_batch: int
    global_batch: int
    precision: Precision
    optimizer: str = "adamw"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise InputError(f"optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        check_int("seq_len", self.seq_len, 1, MAX_SEQ_LEN)
        check_int("micro_batch", self.micro_batch, 1, MAX_BATCH)
        check_int("global_batch", self.global_batch, 1, MAX_BATCH)


@dataclass
class Estimate:
    """One layout of one model: the most loaded GPU's memory and the estimated step time."""

    model: str
    layout: Layout
    memory: Memory
    cpu_per_node: int
    compute_seconds: float
    comm_seconds: float
    offload_seconds: float
    fits: bool
    engine: str
    tokens_per_step: int = field(repr=False)
    microbatches: int = 1  # per pipeline and optimizer step
    bubble: float = 0.0  # idle share of the step (pipeline schedules; `pipeline_bubble`)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds + self.offload_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def estimate(
    config: P2RConfig,
    layout: Layout,
    workload: Workload,
    hardware: Hardware,
    tensors: list[ParameterTensor] | None = None,
    model: str = "",
) -> Estimate:
    """Memory of the most loaded GPU, and the step time of `config` under `layout` with the communication and offload
    time of the slowest pipeline stage (see the module docstring)."""
    tensors = parameter_tensors(config) if tensors is None else tensors
    return _estimate(config, layout, workload, hardware, _Blocks.of(tensors, config), model)


@dataclass
class _Blocks:
    """A model's tensors arranged so that sizing a layout costs one pass over its blocks, not over its tensors: the
    stored blocks of one kind (same tensor shapes and TP dimensions: every block of a dense model) hold the same bytes,
    so each kind's bytes are counted once per layout (the same sums as `model_state_bytes` over every tensor)."""

    others: list[ParameterTensor]  # embeddings, final norm, head
    kind: dict[int, tuple]  # stored block -> its kind
    example: dict[tuple, list[ParameterTensor]]  # kind -> the tensors of one block of that kind
    model: Inventory  # the FLOPs
    splits: dict = field(default_factory=dict)  # (pp, schedule, seq_len) -> the trainer's stages, each split once

    def stages(self, config: P2RConfig, layout: Layout, seq_len: int) -> list[Stage]:
        """`pipeline_stages` of `layout` (the split the trainer runs), computed once per pipeline shape."""
        key = (layout.pp, layout.schedule if layout.pp > 1 else "", seq_len)
        if key not in self.splits:
            self.splits[key] = pipeline_stages(config, layout.pp, seq_len, layout.schedule)
        return self.splits[key]

    @classmethod
    def of(cls, tensors: list[ParameterTensor], config: P2RConfig) -> "_Blocks":
        others, by_block = [], {}
        for tensor in tensors:
            (others if tensor.block is None else by_block.setdefault(tensor.block, [])).append(tensor)
        kind, example = {}, {}
        for block, held in by_block.items():
            kind[block] = tuple((t.shape, t.tp_dim) for t in held)
            example.setdefault(kind[block], held)
        return cls(others, kind, example, inventory(config))


def _estimate(
    config: P2RConfig, layout: Layout, workload: Workload, hardware: Hardware, blocks: _Blocks, model: str
) -> Estimate:
    p = workload.precision
    a, hidden = p.activation, config.hidden_size
    micro_batches = math.ceil(workload.global_batch / (layout.dp * workload.micro_batch))
    tokens = workload.micro_batch * workload.seq_len
    schedule = get_schedule(layout.schedule)
    stages = blocks.stages(config, layout, workload.seq_len)  # the trainer's split
    num_stages = sum(len(stage.parts) for stage in stages)
    order = config.block_of_depth  # a property that builds the list: once
    optimizer = workload.optimizer
    kinds = {kind: model_state_bytes(held, layout, p, optimizer=optimizer) for kind, held in blocks.example.items()}
    kind_numel = {kind: sum(math.prod(t.tp_shape(layout.tp)) for t in held) for kind, held in blocks.example.items()}
    layer = layer_activation_bytes(config, tokens, layout.tp, p)
    per_depth = tokens * a * hidden if layout.recompute else layer
    head = head_activation_bytes(config, tokens, p) + logits_bytes(config, tokens, p)

    tokens_per_step = workload.global_batch * workload.seq_len
    bubble = schedule.bubble(layout.pp, micro_batches)
    compute = _compute_seconds(blocks.model, layout, workload.seq_len, tokens_per_step, hardware) / (1 - bubble)
    memory: Memory | None = None  # of the most loaded process
    comm = offload = 0.0  # of the slowest process: the pipeline runs at its pace
    for stage in stages:
        held = stage_tensors(blocks.others, stage, config.tie_word_embeddings)  # and the blocks of `stage.blocks`
        uses = Counter(order[d] for d in stage.depths)  # depths of this process running each block
        offloaded = set(stage.blocks[: round(layout.offload * len(stage.blocks))])
        stage_memory = model_state_bytes(held, layout, p, offloaded, workload.optimizer)
        units = _unit_numels(held, layout.tp)
        for block in stage.blocks:
            states, units[block] = kinds[blocks.kind[block]], kind_numel[blocks.kind[block]]
            if layout.offloads_everything or block in offloaded:
                stage_memory.cpu += states.model_states + states.cpu  # `states.cpu` when it offloads everything
            else:
                stage_memory.weights += states.weights
                stage_memory.grads += states.grads
                stage_memory.optimizer += states.optimizer
        stage_memory.buffers = _buffer_bytes(units, layout, p, uses, offloaded)
        stage_memory.weights *= schedule.versions(layout.pp)  # 2BW: |W| more per stage
        # Each of its stages holds the activations of the micro-batches in flight there (input ids on the first
        # stage, the head's on the last); with recomputation, one layer's full activations at a time besides.
        stage_memory.activations = layer if layout.recompute else 0
        for index, depths in stage.parts:
            in_flight = schedule.in_flight(num_stages, index, micro_batches)
            per_micro_batch = len(depths) * per_depth + (8 * tokens if index == 0 else 0)
            stage_memory.activations += in_flight * (per_micro_batch + (head if index == num_stages - 1 else 0))

        comm = max(comm, _comm_seconds(config, layout, units, uses, micro_batches, tokens, p, hardware, stage))
        offload = max(offload, _offload_seconds(units, layout, offloaded, uses, micro_batches, p, hardware, compute))
        if memory is None or stage_memory.total > memory.total:
            memory = stage_memory

    cpu_per_node = memory.cpu * min(hardware.gpus_per_node, layout.gpus)
    fits = memory.total + hardware.reserved_gpu_bytes <= hardware.gpu_memory and (
        hardware.cpu_memory is None or cpu_per_node <= hardware.cpu_memory
    )
    split = [len(depths) for _, depths in sorted(part for stage in stages for part in stage.parts)]
    engine = _engine(layout, micro_batches, workload.micro_batch, workload.precision.name, split)
    if workload.optimizer == "muon" and (layout.zero >= 1 or layout.tp > 1):
        engine += "; sizing only: optimizer: muon needs each matrix whole, this layout shards them (use adamw)"
    return Estimate(
        model,
        layout,
        memory,
        cpu_per_node,
        compute,
        comm,
        offload,
        fits,
        engine,
        tokens_per_step,
        micro_batches,
        bubble,
    )


def runnable(layout: Layout, microbatches: int) -> bool:
    """Whether the trainer runs `layout` with `microbatches` per pipeline: the schedule registry's m >= d rule (torch's
    `Schedule1F1B` needs it, and 2BW: with fewer, more than two weight versions would be in flight)."""
    try:
        if layout.pp > 1:
            get_schedule(layout.schedule).check_microbatches(microbatches, layout.pp)
    except ValueError:
        return False
    return True


def stage_seconds(
    config: P2RConfig, tensors: list[ParameterTensor], layout: Layout, workload: Workload, hardware: Hardware
) -> dict:
    """Per-stage seconds of one micro-batch's forward and backward (with recomputation: one more forward) by the cost
    model's FLOP count at `mfu * peak_flops` per GPU, and the send between neighbouring stages (one micro-batch's
    activations at the bandwidth of the link it crosses; ranks placed TP, then DP, then PP): the inputs of
    `hf_p2r.distributed.simulate`. Returns {"stages": [(forward, backward), ...], "p2p": [seconds per boundary]}."""
    tokens, seq_len = workload.micro_batch * workload.seq_len, workload.seq_len
    rate = hardware.peak_flops * hardware.mfu * layout.tp
    model = inventory(config)
    times = []
    for stage in pipeline_stages(config, layout.pp, seq_len, layout.schedule):
        training = sum(model.depth_flops(depth, seq_len) for depth in stage.depths)
        forward = tokens * (training + (model.head.flops if stage.last else 0)) / 3 / rate  # a third: the forward
        times.append((forward, (3 if layout.recompute else 2) * forward))
    volume = tokens * config.hidden_size * workload.precision.activation
    group, per_node = layout.tp * layout.dp, hardware.gpus_per_node
    p2p = [
        volume
        / (
            hardware.intra_node_bandwidth
            if s * group // per_node == (s + 1) * group // per_node
            else hardware.inter_node_bandwidth
        )
        for s in range(layout.pp - 1)
    ]
    return {"stages": times, "p2p": p2p}


def candidate_layouts(config: P2RConfig, gpus: int, hardware: Hardware, max_tp: int, max_pp: int) -> list[Layout]:
    """The layouts the engines run.

    TP degrees divide a node and the attention heads; PP degrees divide the depth. TP composes with FSDP2 (Accelerate's
    `ParallelismConfig(dp_shard_size, tp_size)`); ZeRO-1/2 are DeepSpeed's; granular offload of some blocks is
    hf-p2r's `GranularOffload`, which runs in one process (one GPU: the trainer refuses it otherwise); full offload
    is FSDP2's `CPUOffloadPolicy` or DeepSpeed's ZeRO-3 offload. Pipelines (`max_pp > 1`) are the trainer's
    (`hf_p2r.distributed.pipeline`): each schedule of `PIPELINE_SCHEDULES`, replicated (DDP) or FSDP2-sharded over
    `dp` pipelines, without TP or offload and not for mixture-of-experts models, which it does not pipeline.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    layouts = []
    for tp in _divisors(gpus):
        if tp > min(max_tp, hardware.gpus_per_node) or heads % tp or kv_heads % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > max_pp or config.num_hidden_layers % pp:
                continue
            dp = gpus // (tp * pp)
            if pp > 1:
                if tp == 1 and not getattr(config, "num_experts", 0):
                    layouts += [
                        Layout(dp, 1, pp, zero, 0.0, recompute, schedule)
                        for schedule in PIPELINE_SCHEDULES
                        for zero in ((0, 3) if dp > 1 else (0,))
                        for recompute in (False, True)
                    ]
                continue
            zeros = (0,) if dp == 1 else (3,) if tp > 1 else (0, 1, 2, 3)
            for zero in zeros:
                if zero == 0 and dp == tp == pp == 1:  # granular: whole blocks, so k blocks give at most k + 1 choices
                    blocks = config.num_blocks
                    ratios = sorted({round(ratio * blocks) / blocks for ratio in OFFLOAD_RATIOS})
                else:
                    ratios = (0.0, 1.0) if zero == 3 else (0.0,)
                for offload in ratios:
                    for recompute in (False, True):
                        layouts.append(Layout(dp, tp, pp, zero, offload, recompute))
    return layouts


def plan(
    config: P2RConfig,
    gpus: int,
    workload: Workload,
    hardware: Hardware,
    *,
    max_tp: int = 8,
    max_pp: int = 1,
    model: str = "",
    tensors: list[ParameterTensor] | None = None,
    notes: list[str] | None = None,
) -> list[Estimate]:
    """Every candidate layout of `config` on `gpus` GPUs: the ones that fit first, fastest first, then the rest by
    memory. `tensors`: `parameter_tensors(config)`, when the caller has them already. A pipeline is sized with the
    split the trainer runs (`balanced_split`), and only where the trainer has one.

    The work is bounded: `gpus`, `max_tp` and `max_pp` by `MAX_GPUS` (`InputError` beyond), the model's sizes by
    its config's validation, a layout costs one pass over the model's stored blocks and pipeline stages, and each
    pipeline shape's split is searched once, if that search takes at most `MAX_SPLIT_STEPS` steps (a line appended to
    `notes` says which pipelines are left out)."""
    for name, value in (("gpus", gpus), ("max_tp", max_tp), ("max_pp", max_pp)):
        check_int(name, value, 1, MAX_GPUS)
    blocks = _Blocks.of(parameter_tensors(config) if tensors is None else tensors, config)
    estimates, unsized = [], set()
    for layout in candidate_layouts(config, gpus, hardware, max_tp, max_pp):
        if layout.pp > 1:
            stages = layout.pp * get_schedule(layout.schedule).stages_per_process(VIRTUAL_STAGES)
            cuts = len(allowed_cuts(config)) + 1
            if stages > cuts:  # the trainer has no split: fewer blocks than stages (a `sequence` pseudo model)
                continue
            if stages * cuts**2 > MAX_SPLIT_STEPS:
                unsized.add(stages)
                continue
        estimates.append(_estimate(config, layout, workload, hardware, blocks, model))
    if unsized and notes is not None:
        notes.append(
            f"{model or 'the'} model: pipelines of {min(unsized)} stages or more not sized (the trainer's split of "
            f"{config.num_hidden_layers} layers into that many stages is a search of more than {MAX_SPLIT_STEPS:.0e} "
            "steps)"
        )
    estimates = [e for e in estimates if runnable(e.layout, e.microbatches)]
    return sorted(estimates, key=lambda e: (not e.fits, e.step_seconds if e.fits else e.memory.total))


@dataclass
class PlanInput:
    """The model to plan for, and the run's settings when they are known (`hf-p2r plan` reads them from a trainer
    YAML: plain values, so that planning needs nothing of the trainer)."""

    config: P2RConfig
    seq_len: int | None = None
    micro_batch: int | None = None
    gradient_accumulation_steps: int = 1
    precision: str | None = None
    optimizer: str | None = None
    recompute: bool | None = None
    notes: list[str] = field(default_factory=list)


def read_config(path: str | os.PathLike) -> PlanInput:
    """Read a model config for planning: a model folder or a JSON file (model_type `p2r` or `p2r_moe`, or `llama`:
    read as a real P2R model). (`hf-p2r plan` reads a trainer YAML with the trainer's own reader.)

    A folder's config.json is read as the converter reads it (`read_config_dict`: only a file within the folder;
    `read_p2r_config_dict` for a P2R one), a JSON file by `hf_p2r.errors.read_json`; every field is checked by the
    model's own validators (`validate_layout`, `validate_moe`), sizes bounded, before anything is built from it. Bad
    input raises `InputError` (a `FileNotFoundError` for a missing file) naming the file and the problem.
    """
    path = Path(path)
    if path.is_dir():
        file, values = path / CONFIG_NAME, read_config_dict(path)
    else:
        file, values = path, read_json(path)
    model_type = values.get("model_type")
    config_class = {P2RConfig.model_type: P2RConfig, "llama": P2RConfig, P2RMoeConfig.model_type: P2RMoeConfig}
    if not isinstance(model_type, str) or model_type not in config_class:
        raise InputError(f"{file}: model_type must be 'p2r', 'p2r_moe' or 'llama', got {_cut(repr(model_type))}")
    if path.is_dir() and model_type != "llama":
        read_p2r_config_dict(path)  # the converter's checks, in its words
    values = {key: value for key, value in values.items() if key not in ("model_type", "architectures", "auto_map")}
    if model_type == "llama":  # a Llama model is a real P2R model, whatever sharing fields it carries
        values = {key: value for key, value in values.items() if key not in ("share_layers", "num_unique_layers")}
    try:
        return PlanInput(config_class[model_type].from_dict(values))
    except Exception as error:  # transformers' config classes meet fields of any JSON type: whatever they raise
        raise InputError(f"{file}: {_cut(_last_line(error), 400)}") from None


def _last_line(error: Exception) -> str:
    """The line of a (huggingface_hub validation) message that says what is wrong: its last; the error's type too
    unless it is a `ValueError` (an `IndexError` deep in transformers says little without it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if isinstance(error, (ValueError, StrictDataclassError)) and line else f"{type(error).__name__}: {line}"


def _cut(text: str, limit: int = 120) -> str:
    """`text`, cut to `limit` characters (a message quotes a value, not megabytes of it)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def pseudo_and_real(config: P2RConfig, num_unique_layers: int | None = None) -> tuple[P2RConfig, P2RConfig]:
    """The pseudo model (k blocks: the config's own, else `num_unique_layers`, default 1) and the real model."""
    pseudo, real = copy.deepcopy(config), copy.deepcopy(config)
    depth = config.num_hidden_layers
    k = num_unique_layers or (config.num_blocks if config.share_layers else 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < depth:
        raise InputError(f"num_unique_layers must satisfy 1 <= k < num_hidden_layers ({depth}), got {k!r}")
    pseudo.share_layers, pseudo.num_unique_layers = True, k
    real.share_layers, real.num_unique_layers = False, depth
    for model in (pseudo, real):  # fields set after construction are not checked by the config: checked here
        try:
            validate_layout(model)
            if isinstance(model, P2RMoeConfig):
                validate_moe(model)
        except ValueError as error:
            raise InputError(f"num_unique_layers={k}: {error}") from None
    return pseudo, real


def check_builds(config: P2RConfig) -> None:
    """Build the causal LM of `config` on the meta device (nothing allocated) and drop it: a field its validators do
    not cover (an unknown `hidden_act`, say) fails here as it would in `from_pretrained`. The pseudo model of
    `pseudo_and_real` holds every kind of block the real one does, in k blocks instead of L: check that one."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def _unit_numels(held: list[ParameterTensor], tp: int) -> dict:
    """Elements per FSDP unit on one TP rank: each block, the embedding, and the tail (final norm and head)."""
    units: dict = {}
    for tensor in held:
        key = tensor.block if tensor.block is not None else "embed" if tensor.is_embedding else "tail"
        units[key] = units.get(key, 0) + math.prod(tensor.tp_shape(tp))
    return units


def _buffer_bytes(units: dict, layout: Layout, p: Precision, uses: Counter, offloaded: set) -> int:
    """Transient full copies: FSDP2 gathers a unit (and prefetches the next) and holds its full gradient until the
    reduce-scatter; shared blocks stay gathered all step (`gather_shared_once`). Granular offload: its working set
    (`offload_working_set_bytes`, with the trainer's default prefetch of one block)."""
    if layout.zero >= 3:
        shared = [key for key in units if isinstance(key, int) and uses[key] > 1]
        rest = [numel for key, numel in units.items() if key not in shared]
        kept = sum(units[key] for key in shared) * (p.weight + p.grad)
        return kept + (max(rest, default=0) * (2 * p.weight + p.grad))
    if offloaded:
        numel = max(units[b] for b in offloaded)
        shared = sum(uses[b] > 1 for b in offloaded)
        return offload_working_set_bytes(numel * p.weight, numel * p.grad, offloaded=len(offloaded), shared=shared)
    return 0


def _compute_seconds(model: Inventory, layout: Layout, seq_len: int, tokens_per_step: int, hardware: Hardware) -> float:
    """Seconds of the step's training FLOPs (the inventory's; recomputation runs each depth's forward, a third of its
    FLOPs, once more) spread evenly over the GPUs, before the pipeline bubble."""
    layers = model.flops(seq_len) - model.head.flops
    flops_per_token = layers + (layers / 3 if layout.recompute else 0) + model.head.flops
    return flops_per_token * tokens_per_step / (layout.gpus * hardware.peak_flops * hardware.mfu)


def _comm_seconds(config, layout, units, uses, micro_batches, tokens, p, hardware, stage) -> float:
    gpn = hardware.gpus_per_node
    seconds = 0.0
    if layout.dp > 1:
        numel = sum(units.values())
        weights, grads, share = p.weight * numel, p.grad * numel, (layout.dp - 1) / layout.dp
        if layout.zero == 0:
            volume = 2 * share * grads
        elif layout.zero == 1:
            volume = share * (grads + weights)
        elif layout.zero == 2:
            volume = share * (micro_batches * grads + weights)
        else:
            regathered = sum(n for key, n in units.items() if isinstance(key, int) and uses[key] == 1)
            volume = micro_batches * share * (weights + p.weight * regathered + grads)
        bandwidth = hardware.intra_node_bandwidth if layout.tp * layout.dp <= gpn else hardware.inter_node_bandwidth
        seconds += volume / bandwidth
    if layout.tp > 1:
        share, a, hidden = (layout.tp - 1) / layout.tp, p.activation, config.hidden_size
        volume = len(stage.depths) * 4 * 2 * share * tokens * hidden * a  # 2 all-reduces forward, 2 backward
        if stage.first:
            volume += 2 * share * tokens * hidden * a
        if stage.last:
            volume += 2 * share * tokens * config.vocab_size * a  # gathered logits, and their gradient
        bandwidth = hardware.intra_node_bandwidth if layout.tp <= gpn else hardware.inter_node_bandwidth
        seconds += micro_batches * volume / bandwidth
    if layout.pp > 1:
        volume = 2 * 2 * tokens * config.hidden_size * p.activation  # activations forward, gradients backward
        bandwidth = hardware.intra_node_bandwidth if layout.gpus <= gpn else hardware.inter_node_bandwidth
        seconds += micro_batches * volume / bandwidth
    return seconds


def _offload_seconds(units, layout, offloaded, uses, micro_batches, p, hardware, compute) -> float:
    rest = 0
    if layout.offloads_everything:
        offloaded = {key for key in units if isinstance(key, int)}
        rest = sum(n for key, n in units.items() if not isinstance(key, int))
    elif not offloaded:
        return 0.0
    else:  # granular offload: what the step-time model leaves exposed beside the compute
        blocks = sum(isinstance(key, int) for key in units)
        step = OffloadStep(sum(units[b] for b in offloaded), micro_batches, len(offloaded), blocks, p.weight, p.grad,
                           3 if layout.recompute else 2, sum(uses[b] for b in offloaded) / len(offloaded))  # fmt: skip
        rates = HostRates(update_parameters_per_second=hardware.cpu_adam_params_per_second)
        bus = hardware.pcie_bandwidth
        return predict_step_seconds(compute, step, Design(), rates, bus, bus).seconds - compute
    shard = (lambda n: -(-n // layout.dp)) if layout.zero >= 3 else (lambda n: n)
    reads = 3 if layout.recompute else 2  # forward, backward (and the recomputed forward)
    traffic = sum(shard(units[b]) * (uses[b] * reads * p.weight + p.grad) for b in offloaded)
    traffic += shard(rest) * (2 * p.weight + p.grad)
    numel = sum(shard(units[b]) for b in offloaded) + shard(rest)
    cpu_rate = hardware.cpu_adam_params_per_second / min(hardware.gpus_per_node, layout.gpus)
    return micro_batches * traffic / hardware.pcie_bandwidth + numel / cpu_rate


def _engine(layout: Layout, microbatches: int = 1, micro_batch: int = 1, precision: str = "mixed", split=()) -> str:
    if layout.pp > 1:
        # The trainer's fields (scripts/train.py --config, launched with torchrun): its batch per pipeline,
        # `per_device_batch_size`, is split into `num_microbatches` micro-batches of `micro_batch` sequences.
        fields = [
            f"pipeline_parallel_size: {layout.pp}",
            f"pipeline_schedule: {layout.schedule}",
            f"num_microbatches: {microbatches}",
            f"per_device_batch_size: {microbatches * micro_batch}",
            "gradient_accumulation_steps: 1",  # the micro-batches are the accumulation
        ]
        if split:  # the split sized here: the one the trainer balances itself, written out
            fields.append(f"pipeline_split: [{','.join(map(str, split))}]")
        if layout.dp > 1:
            fields.append(f"data_parallel_size: {layout.dp}")
            if layout.zero == 3:  # FSDP2 in each stage over the data-parallel pipelines
                fields.append("data_parallel_shard: true")
        if layout.recompute:
            fields.append("activation_checkpointing: true")
        if precision == "fp32":
            fields.append('mixed_precision: "no"')  # quoted: YAML reads a bare no as false
        # What `TrainArguments` refuses with a pipeline so far: such layouts are sized, not run.
        schedule = get_schedule(layout.schedule)
        sharded = layout.dp > 1 and layout.zero == 3 and schedule.shard_refusal
        refused = [f"FSDP2-sharded stages under {schedule.title}"] if sharded else []
        refused += ["mixed precision (stages run in fp32)"] if precision != "fp32" else []
        return ", ".join(fields) + (
            f"; sizing only: the trainer refuses {' and '.join(refused)} yet" if refused else ""
        )
    if layout.tp > 1:
        if layout.dp > 1:
            return f"Accelerate ParallelismConfig(dp_shard_size={layout.dp}, tp_size={layout.tp})"
        return f"transformers DistributedConfig(tp_size={layout.tp})"
    if layout.zero == 0:
        if layout.offload:
            return f"one process, offload: {layout.offload:g} (hf-p2r GranularOffload)"
        return "ddp.yaml" if layout.dp > 1 else "one process"
    if layout.zero in (1, 2):
        return f"deepspeed_zero2.yaml (zero_stage: {layout.zero})"
    return "fsdp2_offload.yaml or deepspeed_zero3_offload.yaml" if layout.offload else "fsdp2.yaml"


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, increasing, in O(sqrt(n)) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


__all__ = [
    "OFFLOAD_RATIOS",
    "Estimate",
    "Hardware",
    "PlanInput",
    "Workload",
    "candidate_layouts",
    "check_builds",
    "estimate",
    "plan",
    "pseudo_and_real",
    "read_config",
    "runnable",
    "stage_seconds",
]
