"""Pipeline parallelism for P2R models on `torch.distributed.pipelining`: stages by depth, the split, the schedules,
shared blocks across stages, and the delink of a pipelined model.

A P2R model is cut by depth into `d` stages (`num_stages = pipeline_parallel_size * virtual stages per process`): the
first holds the embeddings, the last the final norm and the head, and each holds the blocks its depths run. Each stage
is a `P2RPipelineStage` module built from the model (the model file knows nothing about pipelines, like transformers'
own models: its `_pp_plan` only names the head) and wrapped in torch's `PipelineStage`; torch's schedules (GPipe, 1F1B,
interleaved 1F1B, interleaved zero bubble) or `SchedulePipeDream2BW` (`pipedream.py`) drive them.

transformers' `apply_pipeline_parallelism` replaces the layers a process does not own by `PipelineIdentityLayer` and
runs the whole forward on every process, one after the other, with no micro-batches: nothing of it is reused here but
the idea of keeping a contiguous range of depths per stage.

Pseudo models:
- `sequence`: a block's depths are contiguous, so the automatic split cuts only between blocks and every block lives
  on one stage (a manual `pipeline_split` that cuts through a block is refused).
- `cycle`: every stage runs the shared blocks, so every stage holds a replica of the blocks its depths use. A
  replicated parameter's gradients are summed over the processes that hold it before the optimizer step (Megatron
  does this for the word embeddings tied across its first and last stage, and so does this module for a tied head),
  so the replicas take the same step and stay bitwise equal. The sum over the stages is what one process gets:
  autograd sums a shared block's gradient over all the depths that ran it.

The delink (`delink_stages`) happens in each process on its own blocks: depth i gets its own copy of the block it ran,
a replica becoming that stage's real block; no replica is left, so the gradient reduction stops by itself.

Costs for the automatic split (`piece_costs`): training FLOPs per token (6 per parameter of a matrix product, plus the
attention scores, 12 * seq * hidden per layer) and bytes of parameters, gradients and Adam state (16 per fp32
parameter). The embedding lookup costs no FLOPs; the head costs 6 * hidden * vocab per token, so a big vocabulary
makes the last stage heavy and the split gives it fewer layers. The split minimises the largest stage's FLOPs, then
its bytes.

Data parallelism beside the pipeline (`pipeline_mesh`): `data_parallel_size` pipelines of `pipeline_parallel_size`
processes on a 2-D DeviceMesh ("dp", "pp"): a process's pipeline is its "pp" row, its data-parallel peers (the same
stage in the other pipelines) its "dp" column. Each pipeline reads its own part of the batch. Replicated stages
(`shard=False`) average their gradients over the column in one coalesced all-reduce after the replicas' sum (what DDP
does, once per step, so it also serves PipeDream-2BW's delayed update); sharded stages (`shard=True`) are FSDP2 units
over the column (`fully_shard` on each block and on the stage, as torchtitan does inside its pipeline stages):
weights, gradients and optimizer state are split over the data-parallel processes, torch's `PipelineStage` defers the
reduce-scatter to the last micro-batch, and the replicas' sum runs on the local shards (the same layout on every stage
of a column). PipeDream-2BW keeps two weight versions and swaps them in the module, which FSDP2's sharded parameters
do not allow: 2BW runs replicated stages only.
"""

import copy
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

from ..models.p2r import P2RForCausalLM, delink_sources
from ..models.p2r.modeling_p2r import CACHE_KWARG
from .fsdp import _local

logger = logging.getLogger(__name__)

# pipeline_schedule values: torch's classes, then PipeDream-2BW (pipedream.py).
TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
SCHEDULES = (*TORCH_SCHEDULES, "2bw")
# Schedules that run several (virtual) stages per process.
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PieceCost:
    """One piece of the model for the split: training FLOPs per token and bytes of training state."""

    name: str
    flops: float
    bytes: float


def piece_costs(config, seq_len: int, bytes_per_param: int = 16) -> tuple[PieceCost, list[PieceCost], PieceCost]:
    """(embeddings, one cost per depth, norm + head) of a P2R config; see the module docstring for the model.

    A depth's bytes are its block's: a pseudo model's stage holds each of its blocks once however many of its depths
    run it (`stage_cost` counts them so).
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer_params = attention + 3 * hidden * config.intermediate_size + 2 * hidden
    layer_flops = 6 * (layer_params - 2 * hidden) + 12 * seq_len * hidden
    embed = PieceCost("embeddings", 0.0, float(vocab * hidden * bytes_per_param))
    head_params = (0 if config.tie_word_embeddings else vocab * hidden) + hidden
    head = PieceCost("head", float(6 * hidden * vocab), float(head_params * bytes_per_param))
    layers = [
        PieceCost(f"layer {depth}", float(layer_flops), float(layer_params * bytes_per_param))
        for depth in range(config.num_hidden_layers)
    ]
    return embed, layers, head


def stage_cost(config, costs, start: int, end: int, first: bool, last: bool) -> tuple[float, float]:
    """(FLOPs per token, bytes) of the stage running depths [start, end)."""
    embed, layers, head = costs
    flops = sum(layers[depth].flops for depth in range(start, end))
    blocks = {config.block_of_depth[depth] for depth in range(start, end)}
    nbytes = len(blocks) * (layers[0].bytes if layers else 0.0)
    if first:
        flops, nbytes = flops + embed.flops, nbytes + embed.bytes
    if last:
        flops, nbytes = flops + head.flops, nbytes + head.bytes
    return flops, nbytes


def allowed_cuts(config) -> list[int]:
    """Depths where a stage may start: every depth, except inside a block of a `sequence` pseudo model."""
    order = config.block_of_depth
    if config.share_layers and config.sharing_pattern == "sequence":
        return [depth for depth in range(1, len(order)) if order[depth] != order[depth - 1]]
    return list(range(1, len(order)))


def balanced_split(config, num_stages: int, seq_len: int) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's (FLOPs, bytes); ValueError if impossible."""
    depth = config.num_hidden_layers
    cuts = [0, *allowed_cuts(config), depth]
    if num_stages > len(cuts) - 1:
        kind = "blocks (sequence pseudo model)" if len(cuts) - 1 < depth else "layers"
        raise ValueError(
            f"pipeline_parallel_size: {num_stages} stages need at least as many {kind}, the model has {len(cuts) - 1}"
        )
    costs = piece_costs(config, seq_len)
    # best[s][j]: the smallest largest-stage cost of s stages covering depths [0, cuts[j]); choice: the previous cut.
    infinite = (float("inf"), float("inf"))
    best = [[infinite] * len(cuts) for _ in range(num_stages + 1)]
    choice = [[0] * len(cuts) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for stages in range(1, num_stages + 1):
        for j in range(1, len(cuts)):
            for i in range(j):
                if best[stages - 1][i] == infinite:
                    continue
                cost = stage_cost(config, costs, cuts[i], cuts[j], i == 0, stages == num_stages and j == len(cuts) - 1)
                candidate = max(best[stages - 1][i], cost)
                if candidate < best[stages][j]:
                    best[stages][j], choice[stages][j] = candidate, i
    bounds, j = [], len(cuts) - 1
    for stages in range(num_stages, 0, -1):
        i = choice[stages][j]
        bounds.append(cuts[j] - cuts[i])
        j = i
    return bounds[::-1]


def check_split(config, split: Sequence[int], num_stages: int) -> list[int]:
    """A manual `pipeline_split` (layers per stage) checked against the model; ValueError naming the field."""
    split = [int(count) for count in split]
    if len(split) != num_stages or any(count < 1 for count in split) or sum(split) != config.num_hidden_layers:
        raise ValueError(
            f"pipeline_split: {split} must give {num_stages} stages at least one layer each, "
            f"{config.num_hidden_layers} layers in all"
        )
    allowed = set(allowed_cuts(config))
    starts = [sum(split[:stage]) for stage in range(1, num_stages)]
    inside = [start for start in starts if start not in allowed]
    if inside:
        raise ValueError(
            f"pipeline_split: {split} starts a stage inside a shared block (at depth {inside[0]}) of this sequence "
            "pseudo model; a block's depths stay on one stage"
        )
    return split


def explain_split(config, split: Sequence[int], seq_len: int, manual: bool) -> str:
    """One log line: the split, how it was chosen, each stage's layers, FLOPs share and training-state bytes."""
    costs = piece_costs(config, seq_len)
    parts, start = [], 0
    stage_costs = []
    for stage, count in enumerate(split):
        end = start + count
        stage_costs.append(stage_cost(config, costs, start, end, stage == 0, stage == len(split) - 1))
        parts.append((start, end))
        start = end
    total = sum(flops for flops, _ in stage_costs) or 1.0
    stages = "; ".join(
        f"stage {stage}: depths {begin}-{end - 1}{' + embeddings' if stage == 0 else ''}"
        f"{' + head' if stage == len(split) - 1 else ''}, {100 * flops / total:.0f}% FLOPs, {nbytes / 2**20:.1f} MiB"
        for stage, ((begin, end), (flops, nbytes)) in enumerate(zip(parts, stage_costs, strict=True))
    )
    how = (
        "manual (pipeline_split)"
        if manual
        else "automatic: the largest stage's training FLOPs per token (then bytes) made smallest, the head's "
        f"{costs[2].flops / max(costs[1][0].flops, 1):.2f} layers of FLOPs counted"
        + (
            ", cuts between blocks only (sequence)"
            if config.share_layers and config.sharing_pattern == "sequence"
            else ""
        )
    )
    return f"pipeline split {list(split)} ({how}): {stages}"


class P2RPipelineStage(nn.Module):
    """The part of a `P2RForCausalLM` that runs depths `depths`: the embeddings if `first`, the blocks those depths
    run (a pseudo model's shared blocks once each), the final norm and head if `last`.

    It holds the model's own modules (no copy); its parameter names are the model's with the `model.` prefix dropped
    (`model_name` maps them back). `forward` takes input ids on the first stage, hidden states elsewhere, and returns
    hidden states, or logits on the last stage. Training only: no cache, no padding mask (full blocks of tokens).
    """

    def __init__(self, model: P2RForCausalLM, depths: range, first: bool, last: bool, config=None):
        super().__init__()
        self.config = config if config is not None else model.config
        self.depths = list(depths)
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        blocks = sorted({self.config.block_of_depth[depth] for depth in self.depths})
        self.layers = nn.ModuleDict({str(block): base.layers[block] for block in blocks})
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = base.rotary_emb

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(hidden_states)
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=None,
            position_ids=position_ids,
            **{CACHE_KWARG: None},
        )
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        order = self.config.block_of_depth
        for depth in self.depths:
            hidden_states = self.layers[str(order[depth])](
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                layer_idx=depth,
            )
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden_states))
        return hidden_states

    def replica_keys(self) -> dict[str, list[str]]:
        """{replication key: parameter names}: a block's key is `layers.<block>`; a head tied to the embeddings shares
        the embeddings' key. Pieces with the same key on several processes are replicas of one parameter."""
        keys: dict[str, list[str]] = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
            if key == "lm_head" and self.config.tie_word_embeddings:
                key = "embed_tokens"
            keys.setdefault(key, []).append(name)
        return keys


def model_name(stage_name: str, tied: bool = False) -> str:
    """A `P2RPipelineStage` parameter name -> the `P2RForCausalLM` one (`tied`: a head tied to the embeddings goes by
    the embeddings' name, as in the model's `named_parameters()` and checkpoints)."""
    if stage_name.startswith("lm_head."):
        return "model.embed_tokens.weight" if tied and stage_name == "lm_head.weight" else stage_name
    return f"model.{stage_name}"


def stage_depths(split: Sequence[int]) -> list[range]:
    bounds = [sum(split[:stage]) for stage in range(len(split) + 1)]
    return [range(bounds[stage], bounds[stage + 1]) for stage in range(len(split))]


def causal_lm_loss(vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the last stage computes per micro-batch: transformers' causal LM loss (shifted labels, token mean),
    what `P2RForCausalLM(input_ids, labels=input_ids).loss` computes."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    return loss_fn


class Pipeline:
    """This process's stages of a pipelined P2R model, their schedule, and the reduction of replicated parameters.

    Build it with `build_pipeline`. `step(input_ids)` runs one optimizer step's micro-batches (forward and backward)
    and sums the replicas' gradients; the caller then steps its optimizer over `parameters()` (for `2bw`, the schedule
    steps it: see `pipedream.py`).
    """

    def __init__(
        self, model, modules, stages, schedule, group, split, schedule_name, num_microbatches, config, mesh, sharded
    ):
        self.modules: list[P2RPipelineStage] = modules
        self.stages: list[PipelineStage] = stages
        self.schedule = schedule
        self.group = group
        self.split = split
        self.schedule_name = schedule_name
        self.num_microbatches = num_microbatches
        self.config = config  # this process's copy: the stages' layout (changes at the delink)
        self.model_config = model.config
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # Every pipeline's ranks (the same list on every process: rows of `mesh`, `pipeline_mesh`), this process's
        # data-parallel column ("dp", None for one pipeline), and whether the stages are sharded over it.
        self.pipelines = mesh.mesh.tolist() if mesh is not None else [dist.get_process_group_ranks(group)]
        self.data_mesh = mesh["dp"] if mesh is not None else None
        self.sharded = sharded
        self.data_size = len(self.pipelines)
        self.data_rank = next(i for i, ranks in enumerate(self.pipelines) if dist.get_rank() in ranks)
        self._replicas = _replica_groups(self)

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This process's parameters, each once, under the model's names."""
        seen = set()
        for module in self.modules:
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield model_name(name, self.config.tie_word_embeddings), param

    def parameters(self) -> list[nn.Parameter]:
        return [param for _, param in self.named_parameters()]

    def shared_lr_scales(self) -> dict[int, float]:
        """{id(parameter): 1/n} for this process's block parameters, n the depths of the whole model running the
        block (`shared_lr_scale: depth`, as `hf_p2r.training.optim.shared_lr_scales` for a whole model)."""
        uses = Counter(self.config.block_of_depth)
        return {
            id(param): 1.0 / uses[int(name.split(".")[2])]
            for name, param in self.named_parameters()
            if name.startswith("model.layers.")
        }

    def step(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch (split into `num_microbatches`); on the last stage, returns the mean loss
        over the micro-batches (None elsewhere). Gradients hold the mean over the micro-batches, replicas summed."""
        losses: list[torch.Tensor] = []
        if self.is_first:
            self.schedule.step(input_ids, target=input_ids if self.is_last else None, losses=losses)
        else:
            self.schedule.step(target=input_ids if self.is_last else None, losses=losses)
        if self.schedule_name != "2bw":  # 2BW reduces and steps inside its schedule
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.div_(self.num_microbatches)  # the mean over the micro-batches
            self.reduce_gradients()
        return torch.stack(losses).mean().detach() if losses else None

    def reduce_gradients(self, params: dict[str, nn.Parameter] | None = None) -> None:
        """Sum the gradients of replicated parameters over the processes of the pipeline holding them, then average
        every gradient over the data-parallel column (replicated stages; FSDP2 has reduce-scattered sharded ones).
        One coalesced all-reduce per group. `params` ({model name: parameter}, default this process's) lets 2BW
        reduce a version."""
        params = dict(self.named_parameters()) if params is None else params
        for names, group in self._replicas:
            _all_reduce_grads([params[name] for name in names], group)
        if self.data_size > 1 and not self.sharded:
            _all_reduce_grads(list(params.values()), self.data_mesh.get_group(), divide=self.data_size)

    def clip_grad_norm_(self, max_norm: float, params: dict[str, nn.Parameter] | None = None) -> torch.Tensor:
        """Clip the gradients of the whole pipelined model to `max_norm` (replicas counted once); returns the norm."""
        params = dict(self.named_parameters()) if params is None else params
        owned = self._owned_names(params)
        square = torch.zeros((), dtype=torch.float64)
        for name in owned:
            grad = params[name].grad
            if grad is not None:
                square += _local(grad).detach().double().pow(2).sum().cpu()
        # Replicated columns hold the same gradients: the pipeline's sum is the norm. Sharded ones hold a part each.
        dist.all_reduce(square, group=None if self.sharded else self.group)
        norm = square.sqrt()
        coefficient = max_norm / (float(norm) + 1e-6)
        if coefficient < 1:
            for param in params.values():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
        return norm.float()

    def _owned_names(self, params) -> list[str]:
        """Names whose gradient this process counts in the norm: a replica is counted by the lowest rank holding it."""
        counted_elsewhere = set()
        for names, group in self._replicas:
            if min(dist.get_process_group_ranks(group)) != dist.get_rank():
                counted_elsewhere.update(names)
        return [name for name in params if name not in counted_elsewhere]

    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """This process's weights under the model's names (a tied head under the embeddings' name); sharded stages
        give the whole weights (`full`: a collective over the data-parallel column) or this process's shards."""
        if not self.sharded:
            return {name: param.detach() for name, param in self.named_parameters()}
        return {name: _full(param) if full else _local(param) for name, param in self.named_parameters()}

    def drain(self) -> None:
        """Finish 2BW's in-flight micro-batches and apply its pending update (nothing to do for flush schedules)."""
        if self.schedule_name == "2bw":
            self.schedule.drain()

    def refresh(self) -> None:
        """Recompute the replica groups after the stages' layout changed (the delink)."""
        self._replicas = _replica_groups(self)


def pipeline_mesh(pipeline_parallel_size: int, data_parallel_size: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D DeviceMesh ("dp", "pp") of `data_parallel_size` pipelines of `pipeline_parallel_size` processes each
    (ranks row by row: a pipeline's processes are consecutive ranks); a collective over the default group."""
    return init_device_mesh(device_type, (data_parallel_size, pipeline_parallel_size), mesh_dim_names=("dp", "pp"))


def _all_reduce_grads(params: list[nn.Parameter], group, divide: int = 1) -> None:
    """Sum (then divide) the gradients of `params` over `group` in one coalesced all-reduce; a missing gradient
    counts as zeros. Sharded parameters reduce their local shards (the same layout on every member)."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [_local(param.grad) for param in params]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) one: a collective over its mesh."""
    return tensor.detach().full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def _replica_groups(pipeline: Pipeline) -> list[tuple[list[str], dist.ProcessGroup]]:
    """[(model names of this process's replicated parameters, process group of the ranks holding them)].

    Every process computes every pipeline's stage keys from the split and the config (the same on all), so all create
    the same groups in the same order, as `new_group` requires.
    """
    config, split = pipeline.config, pipeline.split
    depths = stage_depths(split)
    holders: dict[tuple[int, str], set[int]] = {}  # (pipeline, key) -> ranks
    for index, ranks in enumerate(pipeline.pipelines):
        for stage, stage_range in enumerate(depths):
            rank = ranks[stage % len(ranks)]
            keys = {f"layers.{config.block_of_depth[depth]}" for depth in stage_range}
            if stage == 0:
                keys.add("embed_tokens")
            if stage == len(split) - 1:
                keys.update({"norm", "embed_tokens" if config.tie_word_embeddings else "lm_head"})
            for key in keys:
                holders.setdefault((index, key), set()).add(rank)
    local = {}
    for module in pipeline.modules:
        for key, names in module.replica_keys().items():
            local.setdefault(key, set()).update(model_name(name, config.tie_word_embeddings) for name in names)
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    result = []
    for index, key in sorted(holders):
        members = tuple(sorted(holders[index, key]))
        if len(members) < 2:
            continue
        if members not in groups:
            groups[members] = dist.new_group(list(members))  # collective: every process, same order
        if index == pipeline.data_rank and key in local:
            result.append((sorted(local[key]), groups[members]))
    return result


def build_pipeline(
    model: P2RForCausalLM,
    *,
    schedule: str = "1f1b",
    num_microbatches: int = 4,
    split: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    shard: bool = False,
    virtual_stages: int = 2,
    seq_len: int = 128,
    device: torch.device | str = "cpu",
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    max_grad_norm: float | None = None,
) -> Pipeline:
    """This process's part of `model` as pipeline stages driven by `schedule` over the processes of `group`.

    Every process passes the same model (same weights: built with the same seed or loaded), the same arguments; each
    keeps its stages' pieces (the rest of `model` can be dropped). `split`: layers per stage (manual, checked); None
    balances them (`balanced_split`) and logs the choice. Interleaved schedules run `virtual_stages` stages per
    process (stage s on process s mod size). `2bw` needs `optimizer_factory` (it steps the optimizer itself).

    `mesh` (`pipeline_mesh`) runs data-parallel pipelines: this process's pipeline is its "pp" row (`group` is then
    ignored); `shard` makes each stage FSDP2 units over the "dp" column, else the column's replicas average their
    gradients (see the module docstring).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    config = model.config
    if getattr(config, "num_experts", 0):
        raise ValueError("pipeline_parallel_size: mixture-of-experts P2R models are not supported in a pipeline yet")
    if shard and schedule == "2bw":
        raise ValueError(
            "data_parallel_shard: PipeDream-2BW swaps two weight versions in the stage, which FSDP2's sharded "
            "parameters do not allow; use replicated data-parallel stages (data_parallel_shard: false)"
        )
    if shard and mesh is None:
        raise ValueError("data_parallel_shard: sharded stages need the data-parallel mesh (pipeline_mesh)")
    if mesh is not None:
        group = mesh["pp"].get_group()
    elif group is None:
        group = dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    per_process = virtual_stages if schedule in VIRTUAL_SCHEDULES else 1
    num_stages = size * per_process
    if schedule == "2bw" and num_microbatches < size:
        raise ValueError(
            f"num_microbatches: PipeDream-2BW needs m >= d micro-batches per optimizer step (m={num_microbatches}, "
            f"d={size}): with fewer, more than two weight versions would be in flight"
        )
    if split is None:
        split = balanced_split(config, num_stages, seq_len)
        manual = False
    else:
        split = check_split(config, split, num_stages)
        manual = True
    explanation = explain_split(config, split, seq_len, manual)
    if rank == 0:
        logger.info(explanation)
    stage_config = copy.deepcopy(config)  # this process's layout; the blocks keep the model's config (attention)
    depths = stage_depths(split)
    indices = list(range(rank, num_stages, size))
    modules = [P2RPipelineStage(model, depths[i], i == 0, i == num_stages - 1, stage_config) for i in indices]
    if shard:
        _check_shardable(modules)
        for module in modules:
            shard_stage(module, mesh["dp"])
    device = torch.device(device)
    stages = [
        PipelineStage(module, i, num_stages, device, group=group) for module, i in zip(modules, indices, strict=True)
    ]
    if schedule == "2bw" and optimizer_factory is None:
        raise ValueError("pipeline_schedule: 2bw steps the optimizer itself; pass optimizer_factory")
    runner = _schedule(schedule, stages, num_microbatches, causal_lm_loss(config.vocab_size))
    pipeline = Pipeline(
        model, modules, stages, runner, group, split, schedule, num_microbatches, stage_config, mesh, shard
    )
    pipeline.explanation = explanation
    if schedule == "2bw":
        runner.attach(pipeline, optimizer_factory, max_grad_norm)
    return pipeline


def _schedule(name: str, stages: list[PipelineStage], num_microbatches: int, loss_fn):
    """The schedule object driving this process's `stages`."""
    if name == "2bw":
        from .pipedream import SchedulePipeDream2BW

        return SchedulePipeDream2BW(stages[0], num_microbatches, loss_fn)
    # Gradients are scaled by 1/m in `Pipeline.step`, once per parameter: torch scales per stage, which would scale a
    # block shared by two virtual stages of one process twice.
    return TORCH_SCHEDULES[name](
        stages if name in VIRTUAL_SCHEDULES else stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False
    )


def _check_shardable(modules: list[P2RPipelineStage]) -> None:
    """FSDP2 makes each stage a root unit: a parameter held by two virtual stages of one process (a cycle block, a
    tied head) would belong to two roots. ValueError naming the field."""
    owner: dict[int, int] = {}
    for index, module in enumerate(modules):
        for name, param in module.named_parameters():
            if owner.setdefault(id(param), index) != index:
                raise ValueError(
                    f"data_parallel_shard: {model_name(name)} runs in two virtual stages of one process (a shared "
                    "block or a tied head under an interleaved schedule), which FSDP2 cannot shard; use 1f1b or gpipe"
                )


def shard_stage(module: P2RPipelineStage, mesh: DeviceMesh) -> P2RPipelineStage:
    """FSDP2 on a stage, in place: one unit per block it holds (a shared block is one unit, run at several depths),
    then the stage itself (embeddings, final norm, head), as `fully_shard_p2r` does for a whole model."""
    for block in module.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def delink_stages(pipeline: Pipeline, num_unique_layers: int | None = None) -> dict[str, str]:
    """Delink this process's stages in place to `num_unique_layers` blocks (None: every depth its own block, the real
    model; fewer: a partial delink, e.g. 1 -> 2 -> 4, valid as for `P2RPreTrainedModel.delink`) and return
    {new model name: old model name} for the parameters, to carry optimizer state.

    A new block starts as the block its depths ran: the first new block of an old one on this process keeps the block
    itself, the others get copies (as `P2RPreTrainedModel.delink`, per process). After a full delink a cycle replica is
    this stage's own real blocks, and with no parameter left on two processes the gradient reduction stops; after a
    partial one the replica groups are recomputed for the new blocks.
    """
    config = pipeline.config
    if not config.share_layers:
        raise ValueError("this pipelined model is already real (share_layers=False): there is nothing to delink")
    depth = config.num_hidden_layers
    target = depth if num_unique_layers is None else num_unique_layers
    sources = delink_sources(depth, config.num_unique_layers, target, config.sharing_pattern)
    new_config = copy.deepcopy(config)
    new_config.share_layers, new_config.num_unique_layers = target < depth, target
    if pipeline.sharded:
        return _delink_sharded(pipeline, new_config, sources)
    order = new_config.block_of_depth
    taken: set[int] = set()  # old blocks whose module a new block already kept
    made: dict[int, nn.Module] = {}  # new block -> module, shared by this process's stages
    mapping: dict[str, str] = {}
    for module in pipeline.modules:
        layers = {}
        for index in dict.fromkeys(order[d] for d in module.depths):
            if index not in made:
                block = module.layers[str(sources[index])]
                if sources[index] in taken:
                    block = copy.deepcopy(block, {id(block.self_attn.config): block.self_attn.config})
                taken.add(sources[index])
                block.self_attn.layer_idx = index
                made[index] = block
            layers[str(index)] = made[index]
            for name, _ in made[index].named_parameters():
                mapping[f"model.layers.{index}.{name}"] = f"model.layers.{sources[index]}.{name}"
        module.layers = nn.ModuleDict(layers)
    for name, _ in pipeline.named_parameters():
        mapping.setdefault(name, name)
    config.share_layers, config.num_unique_layers = new_config.share_layers, new_config.num_unique_layers
    pipeline.refresh()
    return mapping


def _delink_sharded(pipeline: Pipeline, new_config, sources: list[int]) -> dict[str, str]:
    """`delink_stages` for FSDP2-sharded stages, without gathering a weight (as `delink_fully_sharded`): new stage
    modules with the new blocks are built on the meta device, sharded over the same column, and filled shard by
    shard (a new block is a copy of the block its depths ran: equal shapes shard equally); then new `PipelineStage`s
    and a new schedule drive them."""
    whole = pipeline_model_config(pipeline)
    whole.share_layers, whole.num_unique_layers = new_config.share_layers, new_config.num_unique_layers
    with torch.device("meta"):
        skeleton = P2RForCausalLM(whole)
    tied = whole.tie_word_embeddings
    mapping: dict[str, str] = {}
    modules, stages = [], []
    for old, old_stage in zip(pipeline.modules, pipeline.stages, strict=True):
        new = P2RPipelineStage(skeleton, old.depths, old.embed_tokens is not None, old.lm_head is not None, new_config)
        shard_stage(new, pipeline.data_mesh)
        new.to_empty(device=_local(next(old.parameters())).device)
        olds = dict(old.named_parameters())
        with torch.no_grad():
            for name, param in new.named_parameters():
                source = name
                if name.startswith("layers."):
                    index, rest = name.split(".", 2)[1:]
                    source = f"layers.{sources[int(index)]}.{rest}"
                _local(param).copy_(_local(olds[source]))
                mapping[model_name(name, tied)] = model_name(source, tied)
        for name, buffer in old.named_buffers():  # the rotary tables
            if not name.startswith("layers."):
                owner, _, leaf = name.rpartition(".")
                new.get_submodule(owner)._buffers[leaf] = buffer.detach().clone()
        new.train(old.training)
        modules.append(new)
        stages.append(
            PipelineStage(new, old_stage.stage_index, old_stage.num_stages, old_stage.device, group=pipeline.group)
        )
    pipeline.modules, pipeline.stages = modules, stages
    loss_fn = causal_lm_loss(whole.vocab_size)
    pipeline.schedule = _schedule(pipeline.schedule_name, stages, pipeline.num_microbatches, loss_fn)
    pipeline.config = new_config  # the new stages' layout
    pipeline.refresh()
    return mapping


def delink_pipeline(
    pipeline: Pipeline,
    optimizer: torch.optim.Optimizer,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    carry: str,
    num_unique_layers: int | None = None,
) -> torch.optim.Optimizer:
    """Delink this process's stages (`delink_stages`, to `num_unique_layers` blocks; None: the real model) and return
    a new optimizer over their parameters, its state carried from `optimizer` as the one-process trainer carries it
    (`optimizer_carry`: reset | copy | scale, with `hf_p2r.training.delink`'s per-parameter rules; scale's ratio n'/n
    counts every depth of the whole model that runs the new block and ran the old one). Under 2BW the pipeline is
    drained first, and its other weight version is delinked alike. Call it on every process of every pipeline at the
    same step, between optimizer steps.
    """
    from ..training.delink import _scaled_state, _to

    if carry not in ("reset", "copy", "scale"):
        raise ValueError(f"optimizer_carry: {carry!r} is not one of reset, copy, scale")
    two_versions = pipeline.schedule_name == "2bw"
    if two_versions:
        pipeline.schedule.drain()
        optimizer = pipeline.schedule.optimizer
    before = dict(pipeline.named_parameters())
    uses = Counter(pipeline.config.block_of_depth)
    tied = pipeline.config.tie_word_embeddings
    old_stage_name = {model_name(name, tied): name for name, _ in pipeline.modules[0].named_parameters()}
    mapping = delink_stages(pipeline, num_unique_layers)
    uses_after = Counter(pipeline.config.block_of_depth)
    new_optimizer = optimizer_factory(pipeline.parameters())
    for name, param in pipeline.named_parameters():
        source = before[mapping[name]]
        state = optimizer.state.get(source)
        if not state:
            continue
        if not name.startswith("model.layers."):  # outside the blocks: keeps its state in every mode
            new_optimizer.state[param] = {key: _to(value, param) for key, value in state.items()}
        elif carry != "reset":
            block, new_block = int(mapping[name].split(".")[2]), int(name.split(".")[2])
            ratio = uses_after[new_block] / uses[block] if carry == "scale" else 1.0
            new_optimizer.state[param] = _scaled_state(state, ratio, param)
    new_optimizer.load_state_dict(new_optimizer.state_dict())
    if two_versions:
        pipeline.schedule.delinked(
            {
                name: old_stage_name[mapping[model_name(name, tied)]]
                for name, _ in pipeline.modules[0].named_parameters()
            }
        )
        pipeline.schedule.optimizer = new_optimizer
    return new_optimizer


def pipeline_state(pipeline: Pipeline, optimizer: torch.optim.Optimizer | None) -> dict:
    """What this process saves of a pipelined run (2BW drained first): its weights under the model's names, its
    optimizer's state, its stages' layout, and under 2BW the other weight version and the schedule's counters.
    Sharded stages save this process's shards (of the weights and of the optimizer state)."""
    state = {
        "weights": pipeline.state_dict(full=False),
        "split": list(pipeline.split),
        "num_unique_layers": pipeline.config.num_unique_layers,
        "share_layers": pipeline.config.share_layers,
        "data_parallel": (pipeline.data_size, pipeline.sharded),
    }
    if pipeline.schedule_name == "2bw":
        schedule = pipeline.schedule
        schedule.drain()
        optimizer = schedule.optimizer
        tied = pipeline.config.tie_word_embeddings
        other = schedule.versions[schedule.batches % 2]
        state["other_version"] = {model_name(name, tied): param.detach() for name, param in other.items()}
        state["batches"], state["updated"] = schedule.batches, schedule.updated
    if optimizer is not None:
        saved = optimizer.state_dict()
        if pipeline.sharded:  # DTensors -> their local shards (plain tensors load with weights_only)
            saved["state"] = {
                index: {key: _local(value) for key, value in values.items()} for index, values in saved["state"].items()
            }
        state["optimizer"] = saved
    return state


def load_pipeline_state(pipeline: Pipeline, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Restore `pipeline_state` into a pipeline built like the saved one (same split and layout) and its optimizer
    (built over `pipeline.parameters()`, or 2BW's own)."""
    size, sharded = state.get("data_parallel", (1, False))
    saved = (list(state["split"]), state["num_unique_layers"], size, sharded)
    if saved != (list(pipeline.split), pipeline.config.num_unique_layers, pipeline.data_size, pipeline.sharded):
        raise ValueError(
            f"resume_from_checkpoint: the checkpoint's pipeline (split {saved[0]}, {saved[1]} blocks, "
            f"data_parallel_size {size}, data_parallel_shard {sharded}) differs from this run's (split "
            f"{pipeline.split}, {pipeline.config.num_unique_layers} blocks, data_parallel_size {pipeline.data_size}, "
            f"data_parallel_shard {pipeline.sharded})"
        )
    params = dict(pipeline.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            _local(param).copy_(state["weights"][name])
    if pipeline.schedule_name == "2bw":
        schedule = pipeline.schedule
        schedule.batches, schedule.updated = state["batches"], state["updated"]
        newest = (schedule.batches - 1) % 2  # where the last update went: the module's parameters
        tied = pipeline.config.tie_word_embeddings
        if schedule.installed != newest:  # the module's set (and the optimizer's) must be the newest
            schedule.versions.reverse()
        schedule.installed = schedule.optimizer_set = newest
        with torch.no_grad():
            for name, param in schedule.versions[1 - newest].items():
                param.copy_(state["other_version"][model_name(name, tied)])
        optimizer = schedule.optimizer
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        if pipeline.sharded:  # the saved local shards -> DTensors laid out like their parameters
            from torch.distributed.tensor import DTensor

            for param, values in optimizer.state.items():
                for key, value in values.items():
                    if torch.is_tensor(value) and value.shape == _local(param).shape and value.dim():
                        values[key] = DTensor.from_local(value, param.device_mesh, param.placements)


def gather_state_dict(pipeline: Pipeline) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on the pipeline's first rank (None elsewhere): each process sends its stages'
    (replicas are equal, the first one received is kept). A collective over the pipeline group."""
    mine = {name: tensor.cpu() for name, tensor in pipeline.state_dict().items()}
    ranks = dist.get_process_group_ranks(pipeline.group)
    gathered = [None] * len(ranks) if dist.get_rank() == ranks[0] else None
    dist.gather_object(mine, gathered, dst=ranks[0], group=pipeline.group)
    if gathered is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return merged


def pipeline_model_config(pipeline: Pipeline):
    """The model config of the pipelined model as it is now (real after `delink_pipeline`)."""
    config = copy.deepcopy(pipeline.model_config)
    config.share_layers, config.num_unique_layers = pipeline.config.share_layers, pipeline.config.num_unique_layers
    return config
