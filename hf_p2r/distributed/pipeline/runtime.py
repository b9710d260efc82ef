"""The pipeline at run time: this process's stages of a P2R model, the schedule driving them, the gradient reduction of
replicated parameters, the gradient norm, and what a checkpoint saves of it.

A P2R model is cut by depth into `d` stages (`num_stages = pipeline_parallel_size * virtual stages per process`,
`split.py`): the first holds the embeddings, the last the final norm and the head, and each holds the blocks its depths
run (`stage.py`). torch's schedules (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble) or hf-p2r's
PipeDream-2BW (`pipedream.py`) drive them, as the registry (`schedules.py`) says.

Pseudo models: a `cycle` model's every stage runs the shared blocks, so every stage holds a replica of the blocks its
depths use. A replicated parameter's gradients are summed over the processes that hold it before the optimizer step
(Megatron does this for the word embeddings tied across its first and last stage, and so does this module for a tied
head), so the replicas take the same step and stay bitwise equal. The sum over the stages is what one process gets:
autograd sums a shared block's gradient over all the depths that ran it. The delink (`delink.py`) happens in each
process on its own blocks; no replica is left afterwards, so the gradient reduction stops by itself.

Data parallelism beside the pipeline (`pipeline_mesh`): `data_parallel_size` pipelines of `pipeline_parallel_size`
processes on a 2-D DeviceMesh ("dp", "pp"): a process's pipeline is its "pp" row, its data-parallel peers (the same
stage in the other pipelines) its "dp" column. Each pipeline reads its own part of the batch. Replicated stages
(`shard=False`) average their gradients over the column in one coalesced all-reduce after the replicas' sum (what DDP
does, once per step, so it also serves PipeDream-2BW's delayed update); sharded stages (`shard=True`) are FSDP2 units
over the column (`fully_shard` on each block and on the stage, as torchtitan does inside its pipeline stages):
weights, gradients and optimizer state are split over the data-parallel processes, and the replicas' sum runs on the
local shards (the same layout on every stage of a column). torch's `PipelineStage` would defer FSDP2's reshard and
reduce-scatter to the step's last backward, holding the whole stage gathered and its gradients whole from the first
backward on; `ShardedPipelineStage` runs each micro-batch's backward as FSDP2 runs any backward (each block resharded
and its gradient reduce-scattered into the shards after its backward: a reduce-scatter per micro-batch), so a
process holds a block or two gathered at a time, as without a pipeline (`stage_class`). A schedule that keeps two
weight versions (2BW) swaps them in the module, which FSDP2's sharded parameters do not allow: the registry refuses
sharded stages for it.

Without a pipeline (`pipeline_parallel_size` 1, `data_parallel_size` N): the whole model is one stage, and the same
code is data parallelism over N processes, FSDP2-sharded (`shard=True`: the layout of `accelerate launch` with the
FSDP2 config, here on CPU/gloo as on GPUs) or replicated (the gradients averaged as DDP does). The stage's forward and
backward then run directly, micro-batch after micro-batch (`AccumulateSchedule`: gradient accumulation, the batch cut
as torch's schedules cut it; one micro-batch's activations at a time, so 1f1b and gpipe are the same there), rather
than through torch's one-stage 1F1B/GPipe, which run but whose `PipelineStage` keeps an FSDP2 stage's weights gathered
and its gradients whole until after the last backward (it defers FSDP2's reshard and reduce-scatter there, for the
pipeline's sake): for the whole model as one stage, the whole model unsharded at once. Run directly, FSDP2 gathers a
block at a time in the forward and the backward (the next one prefetched) and reduce-scatters each block's gradients
after its backward, and a shared block is gathered once per step, kept over its depths (`gather_shared_once`), as
with `accelerate launch` and the FSDP2 config; replicated stages all-reduce once per step. Schedules of several
stages per process or of delayed updates (2BW) have nothing to do with one stage: the registry refuses them
(`check_one_stage`).
"""

import copy
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from ...compat import local_tensor
from ...models.p2r import P2RForCausalLM
from ..materialize import materialize
from .pipedream import SchedulePipeDream2BW
from .schedules import VIRTUAL_STAGES, PipelineSchedule, get_schedule
from .split import balanced_split, check_split, explain_split, stage_depths
from .stage import P2RPipelineStage, ShardedPipelineStage, causal_lm_loss, check_shardable, model_name, shard_stage

logger = logging.getLogger(__name__)
# The config fields a delink changes (`DelinkPlan.fields`; pipelines run no MoE model, whose growth also changes
# `mlp_only_layers`): the stages' layout, which `pipeline_model_config` gives the model.
LAYOUT_FIELDS = ("num_hidden_layers", "num_unique_layers", "share_layers", "real_num_hidden_layers")


class Pipeline:
    """This process's stages of a pipelined P2R model, their schedule, and the reduction of replicated parameters.

    Build it with `build_pipeline`. `step(input_ids)` runs one optimizer step's micro-batches (forward and backward),
    leaving the mean gradient over them, replicas summed; `update` then clips and steps `optimizer` (a schedule that
    updates inside its step, 2BW, has done so there: see `pipedream.py`).
    """

    def __init__(
        self,
        model: P2RForCausalLM,
        modules: list[P2RPipelineStage],
        stages: list[PipelineStage],
        group: dist.ProcessGroup,
        split: list[int],
        spec: PipelineSchedule,
        num_microbatches: int,
        config,
        mesh: DeviceMesh | None,
        sharded: bool,
        max_grad_norm: float | None = None,
        delay_correction: str = "none",
    ):
        self.modules = modules
        self.stages = stages
        self.group = group
        self.split = split
        self.spec = spec
        self.num_microbatches = num_microbatches
        self.config = config  # this process's copy: the stages' layout (changes at the delink)
        self.model_config = model.config
        self.model_class = type(model)  # what the gathered weights load into
        self.max_grad_norm = max_grad_norm  # the gradients are clipped to it before every update (None: never)
        self.delay_correction = delay_correction  # 2BW's (pipedream.py): none or error_feedback
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # Every pipeline's ranks (the same list on every process: rows of `mesh`, `pipeline_mesh`), this process's
        # data-parallel column ("dp", None for one pipeline), and whether the stages are sharded over it.
        self.pipelines = mesh.mesh.tolist() if mesh is not None else [dist.get_process_group_ranks(group)]
        self.data_mesh = mesh["dp"] if mesh is not None else None
        self.sharded = sharded
        self.data_size = len(self.pipelines)
        self.data_rank = next(i for i, ranks in enumerate(self.pipelines) if dist.get_rank() in ranks)
        self.replicas = _replica_groups(self)
        self.schedule = make_schedule(self)
        self.optimizer: torch.optim.Optimizer | None = None  # over `parameters()` (build_pipeline's optimizer_factory)
        self.explanation = ""  # the split, as `build_pipeline` logged it

    @property
    def schedule_name(self) -> str:
        return self.spec.name

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

    def step(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch (split into `num_microbatches`); on the last stage, returns the mean loss
        over the micro-batches (None elsewhere). Gradients hold the mean over the micro-batches, replicas summed."""
        losses: list[torch.Tensor] = []
        inputs = (input_ids,) if self.is_first else ()
        self.schedule.step(*inputs, target=input_ids if self.is_last else None, losses=losses)
        return torch.stack(losses).mean().detach() if losses else None

    def update(self) -> torch.Tensor | None:
        """The optimizer step after `step`: clip the gradients to `max_grad_norm` (if set: the norm is returned), step
        `optimizer` and zero the gradients. A schedule that updates inside its step (2BW) has done all of it there:
        nothing happens and None is returned."""
        if self.spec.updates_inside:
            return None
        norm = self.clip_grad_norm_(self.max_grad_norm) if self.max_grad_norm else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def finish_gradients(self, params: dict[str, nn.Parameter] | None = None, clip: bool = False) -> None:
        """What a schedule does once a batch's backwards are done: the mean over the micro-batches, the replicas'
        sum and the data-parallel average (`reduce_gradients`), and with `clip` the clipping to `max_grad_norm`.
        `params` ({model name: parameter}, default this process's) lets 2BW finish a weight version."""
        params = dict(self.named_parameters()) if params is None else params
        for param in params.values():
            if param.grad is not None:
                param.grad.div_(self.num_microbatches)
        self.reduce_gradients(params)
        if clip and self.max_grad_norm:
            self.clip_grad_norm_(self.max_grad_norm, params)

    def reduce_gradients(self, params: dict[str, nn.Parameter] | None = None) -> None:
        """Sum the gradients of replicated parameters over the processes of the pipeline holding them, then average
        every gradient over the data-parallel column (replicated stages; FSDP2 has reduce-scattered sharded ones).
        One coalesced all-reduce per group."""
        params = dict(self.named_parameters()) if params is None else params
        for names, group in self.replicas:
            _all_reduce_grads([params[name] for name in names], group)
        if self.data_size > 1 and not self.sharded:
            _all_reduce_grads(list(params.values()), self.data_mesh.get_group(), divide=self.data_size)

    def clip_grad_norm_(self, max_norm: float, params: dict[str, nn.Parameter] | None = None) -> torch.Tensor:
        """Clip the gradients of the whole pipelined model to `max_norm` (replicas counted once); returns the norm."""
        params = dict(self.named_parameters()) if params is None else params
        owned = self._owned_names(params)
        # On the stages' device: a collective of NCCL (the GPU launch's only backend) takes no CPU tensor.
        square = torch.zeros((), dtype=torch.float64, device=self.stages[0].device)
        for name in owned:
            grad = params[name].grad
            if grad is not None:
                square += local_tensor(grad).detach().double().pow(2).sum()
        # Replicated columns hold the same gradients: the pipeline's sum is the norm. Sharded ones hold a part each.
        dist.all_reduce(square, group=None if self.sharded else self.group)
        norm = square.sqrt()
        coefficient = max_norm / (float(norm) + 1e-6)
        if coefficient < 1:
            for param in params.values():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
        return norm.float().cpu()

    def _owned_names(self, params) -> list[str]:
        """Names whose gradient this process counts in the norm: a replica is counted by the lowest rank holding it."""
        counted_elsewhere = set()
        for names, group in self.replicas:
            if min(dist.get_process_group_ranks(group)) != dist.get_rank():
                counted_elsewhere.update(names)
        return [name for name in params if name not in counted_elsewhere]

    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """This process's weights under the model's names (a tied head under the embeddings' name); sharded stages
        give the whole weights (`full`: a collective over the data-parallel column) or this process's shards."""
        if not self.sharded:
            return {name: param.detach() for name, param in self.named_parameters()}
        return {name: _full(param) if full else local_tensor(param) for name, param in self.named_parameters()}

    def name_of(self, stage_name: str) -> str:
        """A stage's parameter name -> the model's (`model_name`, with this model's tied head)."""
        return model_name(stage_name, self.config.tie_word_embeddings)

    def drain(self) -> None:
        """Finish the schedule's in-flight micro-batches and pending update (2BW; nothing for flush schedules): before
        a checkpoint, a delink, an evaluation or anything else that sends between the same processes."""
        self.schedule.drain()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each batch's loss (`causal_lm_loss`: the token mean over the batch, what `P2RForCausalLM(input_ids,
        labels=input_ids).loss` is) through this process's stages, forward only: on the last stage the list of losses,
        None elsewhere. Every process of the pipeline passes the same `batches` (input ids).

        The stages' modules run in eval mode on the weights they hold (2BW: the newest version, W(updated), installed
        by `drain`, which runs first); hidden states go from stage to stage by point-to-point sends, as the schedules
        send them, nothing else is gathered. Each process runs its stages batch by batch (its virtual stages in order),
        receiving each input before running it and sending each output asynchronously, so the batches stream through
        the stages; sharded stages gather each unit's weights for its forward (FSDP2) as in training, the same
        forwards on every data-parallel peer.
        """
        self.drain()
        ranks = dist.get_process_group_ranks(self.group)
        num_stages, config = len(self.split), self.model_config
        loss_fn = causal_lm_loss(config.vocab_size)
        mine = [(stage.stage_index, module) for stage, module in zip(self.stages, self.modules, strict=True)]
        device = self.stages[0].device
        dtype = next(iter(self.parameters())).dtype
        modes = [module.training for module in self.modules]
        losses: list[torch.Tensor] = []
        sends: list[tuple[int, dist.Work, torch.Tensor]] = []  # (batch, work, the tensor it sends: kept alive)
        try:
            for module in self.modules:
                module.eval()
            for index, ids in enumerate(batches):
                # A send of two batches ago has been received: its receiver ran everything before (no deadlock).
                while sends and sends[0][0] <= index - 2:
                    sends.pop(0)[1].wait()
                ids = ids.to(device)
                for stage_index, module in mine:
                    if stage_index == 0:
                        hidden = ids
                    else:
                        hidden = torch.empty((*ids.shape, config.hidden_size), dtype=dtype, device=device)
                        dist.recv(hidden, src=ranks[(stage_index - 1) % self.size], group=self.group)
                    output = module(hidden)
                    if stage_index == num_stages - 1:
                        losses.append(loss_fn(output, ids).detach())
                    else:
                        output = output.contiguous()
                        work = dist.isend(output, dst=ranks[(stage_index + 1) % self.size], group=self.group)
                        sends.append((index, work, output))
            for _, work, _ in sends:
                work.wait()
        finally:
            for module, mode in zip(self.modules, modes, strict=True):
                module.train(mode)
                if self.sharded:  # FSDP2 keeps a root's (and `gather_shared_once`'s blocks') weights gathered
                    for unit in module.modules():
                        if isinstance(unit, FSDPModule):
                            unit.reshard()
        return losses if self.is_last else None

    def refresh(self) -> None:
        """Recompute the replica groups after the stages' layout changed (the delink)."""
        self.replicas = _replica_groups(self)


class FlushSchedule:
    """One of torch's schedules behind the interface `Pipeline` drives, which `SchedulePipeDream2BW` also has: each
    step ends with a flush (nothing in flight between steps, one weight version), then the batch's gradients are
    finished (`Pipeline.finish_gradients`); the caller steps the optimizer (`Pipeline.update`)."""

    def __init__(self, schedule, finish_gradients: Callable[[], None]):
        self.schedule, self.finish_gradients = schedule, finish_gradients

    def step(self, *args, target=None, losses: list | None = None) -> None:
        # return_outputs=False: the last stage keeps no micro-batch's logits for a merge nobody reads.
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.finish_gradients()

    def drain(self) -> None:
        """Nothing is in flight after a flush."""

    def delinked(self, mapping: dict[str, str], start: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """One weight version: the module's, which the delink changed itself."""

    def state_dict(self, name_of: Callable[[str], str]) -> dict:
        return {}

    def load_state_dict(self, state: dict, name_of: Callable[[str], str]) -> None:
        """Nothing of a flush schedule is saved."""


class AccumulateSchedule(FlushSchedule):
    """The whole model as one stage (`pipeline_parallel_size` 1): each micro-batch's forward and backward on the stage
    module itself, the gradients summed (gradient accumulation), then finished as a flush schedule's. The batch is cut
    as torch's schedules cut it (`tensor_split` on the batch dimension), so it computes what their one-stage 1F1B
    does; FSDP2's own hooks gather, reshard and reduce-scatter each block (see the module docstring)."""

    def __init__(self, module: nn.Module, num_microbatches: int, loss_fn, finish_gradients: Callable[[], None]):
        super().__init__(None, finish_gradients)
        self.module, self.num_microbatches, self.loss_fn = module, num_microbatches, loss_fn

    def step(self, input_ids: torch.Tensor, target=None, losses: list | None = None) -> None:
        for ids, labels in zip(
            input_ids.tensor_split(self.num_microbatches), target.tensor_split(self.num_microbatches), strict=True
        ):
            loss = self.loss_fn(self.module(ids), labels)
            loss.backward()
            if losses is not None:
                losses.append(loss.detach())
        self.finish_gradients()


def make_schedule(pipeline: Pipeline):
    """The schedule object driving this process's stages, as the registry describes `pipeline.spec` (one stage: the
    micro-batches accumulated on it, `AccumulateSchedule`)."""
    spec, stages = pipeline.spec, pipeline.stages
    loss_fn = causal_lm_loss(pipeline.model_config.vocab_size)
    if len(pipeline.split) == 1:  # `check_one_stage`: a flush schedule
        return AccumulateSchedule(pipeline.modules[0], pipeline.num_microbatches, loss_fn, pipeline.finish_gradients)
    if spec.torch_name is None:  # hf-p2r's own: PipeDream-2BW
        return SchedulePipeDream2BW(
            stages[0],
            pipeline.num_microbatches,
            loss_fn,
            finish_gradients=lambda params: pipeline.finish_gradients(
                {pipeline.name_of(name): param for name, param in params.items()}, clip=True
            ),
            optimizer=lambda: pipeline.optimizer,
            delay_correction=pipeline.delay_correction,
        )
    # Gradients are scaled by 1/m in `finish_gradients`, once per parameter: torch scales per stage, which would scale
    # a block shared by two virtual stages of one process twice.
    runner = get_schedule_class(spec.torch_name)(
        stages if spec.virtual_stages else stages[0], pipeline.num_microbatches, loss_fn=loss_fn, scale_grads=False
    )
    return FlushSchedule(runner, finish_gradients=pipeline.finish_gradients)


def stage_class(spec: PipelineSchedule, sharded: bool) -> type[PipelineStage]:
    """What drives a stage module: torch's `PipelineStage`, or for FSDP2-sharded stages of a schedule of one stage per
    process `ShardedPipelineStage` (each micro-batch's backward reshards and reduce-scatters: a block or two gathered
    at once, not the whole stage). Interleaved schedules keep torch's: they gather a whole virtual stage around its
    micro-batches anyway (their UNSHARD and RESHARD actions)."""
    return ShardedPipelineStage if sharded and not spec.virtual_stages else PipelineStage


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
    grads = [local_tensor(param.grad) for param in params]
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
    virtual_stages: int = VIRTUAL_STAGES,
    seq_len: int = 128,
    device: torch.device | str = "cpu",
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    max_grad_norm: float | None = None,
    delay_correction: str = "none",
    seed: int | None = None,
) -> Pipeline:
    """This process's part of `model` as pipeline stages driven by `schedule` over the processes of `group`.

    Every process passes the same model (same weights: built with the same seed or loaded), the same arguments; each
    keeps its stages' pieces (the rest of `model` can be dropped). A model built on the meta device is materialised
    here, only this process's stages (sharded ones: only their shards), initialised from `seed` by
    `hf_p2r.distributed.materialize`: the same weights as the whole model materialised in one process. `split`:
    layers per stage (manual, checked); None balances them (`balanced_split`) and logs the choice. Interleaved
    schedules run `virtual_stages` stages per process (stage s on process s mod size). `optimizer_factory` makes
    `Pipeline.optimizer` over the stages' parameters (or set it before the first `update`; a schedule that steps it
    itself, 2BW, needs it before its first update); `max_grad_norm` clips before every update; `delay_correction`
    ("error_feedback") corrects 2BW's delayed update (`pipedream.py`), and is refused for a schedule whose updates are
    not delayed.

    `mesh` (`pipeline_mesh`) runs data-parallel pipelines: this process's pipeline is its "pp" row (`group` is then
    ignored); `shard` makes each stage FSDP2 units over the "dp" column, else the column's replicas average their
    gradients (see the module docstring); `pipeline_mesh(1, N)` runs the whole model as one stage, N ways data
    parallel (1f1b or gpipe: the micro-batches are gradient accumulation).
    """
    spec = get_schedule(schedule)
    if delay_correction != "none" and spec.name != "2bw":
        raise ValueError(
            f"pipeline_delay_correction: corrects PipeDream-2BW's delayed update; {schedule}'s updates are not delayed"
        )
    config = model.config
    if getattr(config, "num_experts", 0):
        raise ValueError("pipeline_parallel_size: mixture-of-experts P2R models are not supported in a pipeline yet")
    if shard:
        spec.check_shardable()
        if mesh is None:
            raise ValueError("data_parallel_shard: sharded stages need the data-parallel mesh (pipeline_mesh)")
    if mesh is not None:
        group = mesh["pp"].get_group()
    elif group is None:
        group = dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    spec.check_one_stage(size)
    num_stages = size * spec.stages_per_process(virtual_stages)
    spec.check_microbatches(num_microbatches, size)
    manual = split is not None
    split = check_split(config, split, num_stages) if manual else balanced_split(config, num_stages, seq_len)
    explanation = explain_split(config, split, seq_len, manual)
    if rank == 0:
        logger.info(explanation)
    stage_config = copy.deepcopy(config)  # this process's layout; the blocks keep the model's config (attention)
    depths = stage_depths(split)
    indices = list(range(rank, num_stages, size))
    modules = [P2RPipelineStage(model, depths[i], i == 0, i == num_stages - 1, stage_config) for i in indices]
    if shard:
        check_shardable(modules)
        for module in modules:
            shard_stage(module, mesh["dp"], model)
    if any(param.is_meta for param in model.parameters()):
        if seed is None:
            raise ValueError("build_pipeline: the model is on the meta device; pass the run's seed to materialise it")
        if shard:  # FSDP2 allocates the local shards; `materialize` fills them
            for module in modules:
                module.to_empty(device=mesh["dp"].device_type)
        materialize(model, seed, keep=modules)
    device = torch.device(device)
    stages = [
        stage_class(spec, shard)(module, i, num_stages, device, group=group)
        for module, i in zip(modules, indices, strict=True)
    ]
    pipeline = Pipeline(
        model,
        modules,
        stages,
        group,
        split,
        spec,
        num_microbatches,
        stage_config,
        mesh,
        shard,
        max_grad_norm,
        delay_correction,
    )
    pipeline.explanation = explanation
    if optimizer_factory is not None:
        pipeline.optimizer = optimizer_factory(pipeline.parameters())
    return pipeline


def pipeline_state(pipeline: Pipeline, optimizer: torch.optim.Optimizer | None) -> dict:
    """What this process saves of a pipelined run (the schedule drained first): its weights under the model's names,
    `optimizer`'s state, its stages' layout, and what the schedule keeps (2BW: the other weight version and its
    counters). Sharded stages save this process's shards (of the weights and of the optimizer state)."""
    pipeline.drain()
    state = {
        "weights": pipeline.state_dict(full=False),
        "split": list(pipeline.split),
        "num_unique_layers": pipeline.config.num_unique_layers,
        "share_layers": pipeline.config.share_layers,
        "data_parallel": (pipeline.data_size, pipeline.sharded),
        **pipeline.schedule.state_dict(pipeline.name_of),
    }
    if optimizer is not None:
        saved = optimizer.state_dict()
        if pipeline.sharded:  # DTensors -> their local shards (plain tensors load with weights_only)
            saved["state"] = {
                index: {key: local_tensor(value) for key, value in values.items()}
                for index, values in saved["state"].items()
            }
        state["optimizer"] = saved
    return state


def load_pipeline_state(pipeline: Pipeline, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Restore `pipeline_state` into a pipeline built like the saved one (same split and layout) and `optimizer`
    (over `pipeline.parameters()`: `pipeline.optimizer`, or the caller's)."""
    size, sharded = state.get("data_parallel", (1, False))
    saved = (list(state["split"]), state["num_unique_layers"], size, sharded)
    if saved != (list(pipeline.split), pipeline.config.num_unique_layers, pipeline.data_size, pipeline.sharded):
        raise ValueError(
            f"resume_from_checkpoint: the checkpoint's pipeline (split {saved[0]}, {saved[1]} blocks, "
            f"data_parallel_size {size}, data_parallel_shard {sharded}) differs from this run's (split "
            f"{pipeline.split}, {pipeline.config.num_unique_layers} blocks, data_parallel_size {pipeline.data_size}, "
            f"data_parallel_shard {pipeline.sharded}); resume it with its layout (a checkpoint_format dcp "
            "checkpoint, the default of several processes, resumes on any layout)"
        )
    params = dict(pipeline.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            local_tensor(param).copy_(state["weights"][name])
    pipeline.schedule.load_state_dict(state, pipeline.name_of)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        if pipeline.sharded:  # the saved local shards -> DTensors laid out like their parameters
            from torch.distributed.tensor import DTensor

            for param, values in optimizer.state.items():
                for key, value in values.items():
                    if torch.is_tensor(value) and value.shape == local_tensor(param).shape and value.dim():
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
    """The model config of the pipelined model as it is now (real after the delink, deeper after a growth)."""
    config = copy.deepcopy(pipeline.model_config)
    for key in LAYOUT_FIELDS:
        setattr(config, key, getattr(pipeline.config, key))
    return config


__all__ = [
    "AccumulateSchedule",
    "FlushSchedule",
    "Pipeline",
    "build_pipeline",
    "gather_state_dict",
    "load_pipeline_state",
    "make_schedule",
    "pipeline_mesh",
    "pipeline_model_config",
    "pipeline_state",
    "stage_class",
]
