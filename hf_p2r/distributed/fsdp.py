"""FSDP2 for P2R models: every stored block is one FSDP unit (a pseudo model's shared block is one unit called at
several depths), and `delink` of a sharded model without gathering it.

torch's `fully_shard` (FSDP2) supports a module that runs several times per step (torch tests it in
`test_multi_forward_module`, `test/distributed/_composable/fsdp/test_fully_shard_training.py`): each call all-gathers
in its pre-forward hook and, with the default `reshard_after_forward=True`, reshards after it and all-gathers again in
the backward. The gradient is reduce-scattered once, because autograd sums a leaf's gradient over all its uses before
writing `.grad`. So a pseudo block used at n = L/k depths costs 2n all-gathers per step. `gather_shared_once` keeps a
shared block unsharded from its first use in the forward to its last use in the backward: one all-gather and one
reduce-scatter per step, so the pseudo stage moves k blocks per step, not L, for k extra unsharded blocks in memory.

Under Accelerate (`fsdp_version: 2`, `fsdp_transformer_layer_cls_to_wrap: P2RDecoderLayer`) the stored blocks are
the units already; call `gather_shared_once(model)` after `accelerator.prepare` to get the schedule above. Accelerate
turns FSDP on only for accelerators: on CPU the plugin is ignored, which is why the CPU tests call `fully_shard_p2r`
(and Accelerate's `fsdp2_prepare_model`) directly.

DeepSpeed: `partition_zero3` turns a meta-device model into ZeRO-3 partitions one module at a time (what
`deepspeed.zero.Init` does for a model built inside it), `materialize_zero3` with the layout-independent
initialisation (`hf_p2r.distributed.materialize`); `delink_deepspeed` delinks a DeepSpeed engine's model (ZeRO-3:
straight into the new model's partitions), `gather_deepspeed_model` copies it whole; `zero3_owned_state` gives each
process its share of the whole tensors, one gathered parameter at a time, for `save_model_from_shards`;
`zero3_training_state` / `set_zero3_training_state` do the same with the fp32 master weights and the optimizer state,
for DCP resume checkpoints any layout reads (`hf_p2r.training.dcp`).
"""

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..compat import local_tensor, reshard_after_backward
from ..models.p2r import P2RPreTrainedModel, delink_sources
from .materialize import materialize


def fully_shard_p2r(
    model: P2RPreTrainedModel,
    *,
    mesh=None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    shared_gather_once: bool = True,
) -> P2RPreTrainedModel:
    """Apply FSDP2 in place: one unit per stored block, then the root unit (embeddings, final norm, head).

    A block is never split across units, so a shared block's parameters belong to exactly one FSDP group (FSDP2
    refuses a parameter seen by two groups). With `shared_gather_once` (the default) shared blocks follow the
    schedule of `gather_shared_once`; real blocks reshard after forward as `reshard_after_forward` says.

    ```python
    >>> mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world_size,))
    >>> fully_shard_p2r(model, mesh=mesh)
    >>> optimizer = torch.optim.AdamW(model.parameters())   # over the sharded (DTensor) parameters
    ```
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in model.base_model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    if shared_gather_once:
        gather_shared_once(model)
    return model


def gather_shared_once(model: P2RPreTrainedModel, depths: Iterable[int] | None = None) -> P2RPreTrainedModel:
    """Make every shared block of an FSDP2-sharded pseudo model all-gather once per step instead of twice per depth
    that runs it. Returns the model; real blocks are left as they are.

    The block stays unsharded (one full copy per rank, like FSDP's root unit) from its first use in the forward to
    its last use in the backward (the first depth), where it reshards as usual. Like the root unit, it stays
    unsharded after a forward without backward (evaluation) until the next backward. Call it after
    `fully_shard_p2r(..., shared_gather_once=False)` or after `accelerator.prepare`; calling it twice is harmless.
    `depths`: the depths this process runs (a pipeline stage's; default all): a block is shared if two of them run
    it, and the first of them is its last use in the backward; blocks no depth of them runs are left alone.
    """
    config = model.config
    first_depth: dict[int, int] = {}
    uses: dict[int, int] = {}
    for depth in range(len(config.block_of_depth)) if depths is None else sorted(depths):
        block = config.block_of_depth[depth]
        first_depth.setdefault(block, depth)
        uses[block] = uses.get(block, 0) + 1
    for index, block in enumerate(model.base_model.layers):
        if uses.get(index, 0) < 2 or getattr(block, "_p2r_gather_once", False):
            continue
        if not isinstance(block, FSDPModule):
            raise ValueError(
                f"model.layers.{index} is not an FSDP2 unit: shard each stored block with fully_shard first "
                "(fully_shard_p2r, or Accelerate with fsdp_transformer_layer_cls_to_wrap: P2RDecoderLayer)"
            )
        block.set_reshard_after_forward(False, recurse=False)
        block.register_forward_hook(_SyncOnLastUse(block, first_depth[index]), with_kwargs=True)
        block._p2r_gather_once = True
    return model


class _SyncOnLastUse:
    """Forward hook of a shared block: tags each use's output so that, in the backward, every use but the last one
    (the first depth) leaves the block unsharded for the next."""

    def __init__(self, block: FSDPModule, first_depth: int):
        self.block = block
        self.first_depth = first_depth
        self.user_setting: bool | None = None

    def __call__(self, module: nn.Module, args, kwargs, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return output
        depth = kwargs.get("layer_idx")
        if depth is None:
            raise ValueError("a shared P2R block was called without layer_idx: gather_shared_once needs the depth")
        return _BackwardSwitch.apply(self, depth == self.first_depth, output)

    def switch(self, last_use: bool) -> None:
        # FSDP2 reads the flag in the post-backward hook of this use, which runs after this switch. The user's value
        # (`set_reshard_after_backward` has no public getter: see hf_p2r.compat) is restored for the last use.
        if not last_use:
            if self.user_setting is None:
                self.user_setting = reshard_after_backward(self.block)
            self.block.set_reshard_after_backward(False, recurse=False)
        elif self.user_setting is not None:
            self.block.set_reshard_after_backward(self.user_setting, recurse=False)
            self.user_setting = None


class _BackwardSwitch(torch.autograd.Function):
    """Identity in the forward; in the backward, before the block's own backward, sets how FSDP ends this use."""

    @staticmethod
    def forward(ctx, hook: _SyncOnLastUse, last_use: bool, output: torch.Tensor) -> torch.Tensor:
        ctx.hook, ctx.last_use = hook, last_use
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hook.switch(ctx.last_use)
        return None, None, grad


def delink_fully_sharded(
    model: P2RPreTrainedModel,
    num_unique_layers: int | None = None,
    *,
    shard: Callable[[nn.Module], nn.Module],
) -> tuple[P2RPreTrainedModel, dict[str, str]]:
    """Delink an FSDP2-sharded pseudo model without gathering it; returns `(new_model, parameter_map)`.

    `delink` cannot run in place on a sharded model (it deep-copies blocks, and FSDP2's state would be copied with
    them). Instead a new model with the delinked config is built on the meta device, sharded by `shard` (e.g.
    `functools.partial(fully_shard_p2r, mesh=mesh)`: the same layout as the old model), allocated, and filled rank
    by rank: a new block is a copy of an old block of the same shapes, and FSDP2 shards equal shapes equally on the
    same mesh, so each rank's shard of the new block is its shard of the old one. No parameter is ever gathered.

    `parameter_map` is `{new parameter name: old parameter name}` (`delink_parameter_map`), for carrying optimizer
    state: the optimizer state tensors are DTensors laid out like their parameters, so they carry shard by shard too.
    The caller drops the old model and optimizer afterwards. Buffers (rotary tables) are copied from the old model.
    """
    config = model.config
    target = config.num_hidden_layers if num_unique_layers is None else num_unique_layers
    if not config.share_layers:
        raise ValueError("this model is already real (share_layers=False): there is nothing to delink")
    sources = delink_sources(config.num_hidden_layers, config.num_unique_layers, target, config.sharing_pattern)
    parameter_map = model.delink_parameter_map(target)
    old_parameters = dict(model.named_parameters())
    dtypes = {parameter.dtype for parameter in old_parameters.values()}
    if len(dtypes) != 1:
        raise ValueError(f"delink_fully_sharded needs one parameter dtype, the model has {sorted(map(str, dtypes))}")

    new_config = copy.deepcopy(config)
    new_config.share_layers = len(sources) < config.num_hidden_layers
    new_config.num_unique_layers = len(sources)
    model_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    with torch.device("meta"):
        new_model = model_class(new_config).to(dtypes.pop())
    new_model = shard(new_model)

    first = next(iter(old_parameters.values()))
    new_model.to_empty(device=local_tensor(first).device)
    with torch.no_grad():
        for name, parameter in new_model.named_parameters():
            source = old_parameters[parameter_map[name]]
            if getattr(parameter, "placements", None) != getattr(source, "placements", None) or (
                local_tensor(parameter).shape != local_tensor(source).shape
            ):
                raise ValueError(
                    f"{name}: the new model is not sharded like the old one ({_layout(parameter)} vs "
                    f"{_layout(source)}); pass a `shard` that applies the old model's FSDP layout"
                )
            local_tensor(parameter).copy_(local_tensor(source))
            parameter.requires_grad_(source.requires_grad)
    _copy_buffers(model, new_model)
    new_model.train(model.training)
    return new_model, parameter_map


def gather_deepspeed_model(engine) -> P2RPreTrainedModel:
    """A plain copy of a DeepSpeed engine's P2R model on every rank, with the full fp32 master weights (ZeRO-1/2/3).

    DeepSpeed's delink transition: `gather_deepspeed_model(engine).delink()`, then a new optimizer and a new engine
    (`deepspeed.initialize`, or `accelerator.prepare` on the new model and optimizer). The weights come from
    DeepSpeed's `safe_get_full_fp32_param` (a collective under ZeRO-3: every rank must call this), so no precision is
    lost; the optimizer state restarts (DeepSpeed keeps it in flat partitions with no per-parameter carry).
    The copy lives in CPU memory: the pseudo model's k blocks, delinked there to L.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    state = {name: safe_get_full_fp32_param(p).detach().to("cpu", copy=True) for name, p in module.named_parameters()}
    config = copy.deepcopy(module.config)
    with torch.device("meta"):
        model = type(module)(config)
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    if unexpected or set(missing) - tied:
        raise ValueError(f"could not rebuild the model from DeepSpeed: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    _copy_buffers(module, model, device="cpu")
    return model.train(module.training)


def zero3_units(model: nn.Module) -> list[list[nn.Module]]:
    """The model's modules in the groups `partition_zero3` materialises together, in the model's order: each module
    that holds parameters or buffers of its own, with the modules whose parameters are tied to its own (a head tied
    to the embeddings) and its submodules (they are materialised with it, so never in a group of their own)."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    first_name: dict[int, str] = {}
    groups: dict[str, list[nn.Module]] = {}  # owning module name -> the modules that take its tensors
    for module_name, module in model.named_modules():
        for key, param in module.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{module_name}.{key}" if module_name else key
            owning = tied.get(name, first_name.setdefault(id(param), name))
            groups.setdefault(owning.rpartition(".")[0], []).append(module)
        if any(True for _ in module.buffers(recurse=False)):
            groups.setdefault(module_name, []).append(module)
    units, covered = [], set()
    for modules in groups.values():
        unit = [module for module in {id(m): m for m in modules}.values() if id(module) not in covered]
        if unit:
            covered |= {id(sub) for module in unit for sub in module.modules()}
            units.append(unit)
    return units


def partition_zero3(
    model: nn.Module,
    fill: Callable[[list[nn.Module]], Any],
    config: dict | str | None = None,
    *,
    like: nn.Parameter | None = None,
) -> nn.Module:
    """Materialise the meta-device `model` as DeepSpeed ZeRO-3 partitions, in place: no process ever holds more than
    one group of `zero3_units` whole beside its own partitions. Returns the model, for `deepspeed.initialize` (or
    `accelerator.prepare`), which takes the partitioned parameters as they are.

    For each group `fill(modules)` allocates and fills the whole tensors of those modules (and their submodules) on
    the CPU, then `deepspeed.zero.Init(module=..., config_dict_or_path=config)` (the first group) or the partitioned
    parameters' own `convert_to_zero_parameters` (the rest: the same settings) keeps this process's partition of each
    parameter and frees the whole tensor: what `zero.Init` does for a model constructed inside it, one module at a
    time. Every process must call it (DeepSpeed broadcasts each parameter from the first process of its group, then
    partitions it), with the same `fill` results for the weights to be layout-independent. Buffers (the rotary
    tables) stay whole on every process, as ZeRO-3 keeps them.

    `config` is the DeepSpeed configuration (its `zero_optimization.offload_param` places the partitions in CPU
    memory, as `deepspeed.initialize` would). `like`, a ZeRO-3 parameter, partitions every group with its settings
    instead (a delink: the old model's).

    The floating-point parameters are cast to the dtype `zero.Init` gives a model built inside it (the configuration's
    bf16 or fp16, else fp32; with `like`, its dtype): `Init(module=...)` keeps the dtype it is given, and DeepSpeed's
    engine casts only a model that is not partitioned yet, so without the cast a bf16 run would train fp32 partitions.
    """
    import deepspeed

    anchor = like  # a partitioned parameter: converts the others with its Init's settings
    dtype = like.dtype if like is not None else None
    if like is None and config is not None:
        dtype = deepspeed.zero.Init(config_dict_or_path=config).dtype  # (no module: nothing converted, no context)
    for unit in zero3_units(model):
        fill(unit)
        pending = {id(p): p for module in unit for p in module.parameters() if not hasattr(p, "ds_id")}
        for param in pending.values():
            if dtype is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        if pending and anchor is None:
            holder = nn.ModuleList(unit)  # Init(module=...) partitions one module's parameters (a tie once)
            deepspeed.zero.Init(module=holder, config_dict_or_path=config)
            anchor = next(iter(pending.values()))
        elif pending:
            anchor.convert_to_zero_parameters(param_list=list(pending.values()))
    return model


def materialize_zero3(model: nn.Module, seed: int, config: dict | str | None = None) -> nn.Module:
    """`partition_zero3` with the layout-independent initialisation (`hf_p2r.distributed.materialize` under `seed`):
    the partitions gather to the weights `materialize(model, seed)` gives one process, bitwise (cast to the
    configuration's dtype under bf16 or fp16)."""
    return partition_zero3(model, lambda unit: materialize(model, seed, keep=unit), config)


def delink_deepspeed(engine, num_unique_layers: int | None = None) -> nn.Module:
    """The delinked copy of a DeepSpeed engine's P2R model, for a new engine (`deepspeed.initialize` or
    `accelerator.prepare`, with a new optimizer: DeepSpeed's flat ZeRO partitions have no per-parameter state to carry).
    Every rank must call it (it gathers).

    Under ZeRO-3 (partitioned parameters) the new model is built on the meta device and partitioned by
    `partition_zero3` with the old parameters' settings (`like`), each new module filled from the full fp32 master
    weights of the old parameters it copies (`safe_get_full_fp32_param`, one parameter at a time), so no process
    holds either model whole. Under ZeRO-1/2 every process holds the model anyway:
    `gather_deepspeed_model(engine).delink(num_unique_layers)`.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        return gather_deepspeed_model(engine).delink(num_unique_layers)
    old_config = module.config
    target = old_config.num_hidden_layers if num_unique_layers is None else num_unique_layers
    if not old_config.share_layers:
        raise ValueError("this model is already real (share_layers=False): there is nothing to delink")
    sources = delink_sources(
        old_config.num_hidden_layers, old_config.num_unique_layers, target, old_config.sharing_pattern
    )
    parameter_map = module.delink_parameter_map(target)
    old_parameters, old_buffers = dict(module.named_parameters()), dict(module.named_buffers())
    new_config = copy.deepcopy(old_config)
    new_config.share_layers = len(sources) < old_config.num_hidden_layers
    new_config.num_unique_layers = len(sources)
    with torch.device("meta"):
        new_model = type(module)(new_config)
    names = {id(sub): name for name, sub in new_model.named_modules()}

    @torch.no_grad()
    def fill(unit: list[nn.Module]) -> None:
        placed: dict[int, nn.Parameter] = {}  # a tied parameter: one tensor in every slot
        for root in unit:
            for sub in root.modules():
                prefix = names[id(sub)] + "." if names[id(sub)] else ""
                for key, param in sub.named_parameters(recurse=False):
                    if id(param) not in placed:
                        source = old_parameters[parameter_map[prefix + key]]
                        whole = safe_get_full_fp32_param(source).detach().to("cpu", copy=True)
                        placed[id(param)] = nn.Parameter(whole, requires_grad=source.requires_grad)
                    setattr(sub, key, placed[id(param)])
                for key, _ in sub.named_buffers(recurse=False):
                    setattr(sub, key, old_buffers[prefix + key].detach().to("cpu", copy=True))

    partition_zero3(new_model, fill, like=next(iter(old_parameters.values())))
    return new_model.train(module.training)


def zero3_owned_state(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """This process's share of a DeepSpeed ZeRO-3 model's whole tensors, for `save_model_from_shards`: every tensor of
    `model.state_dict()` (ZeRO-3 parameters and the buffers, which ZeRO-3 keeps whole) is given to one process of
    `group` (default: all), which keeps a CPU copy of it; the others hold none of it. The shares are balanced by bytes
    (the largest tensors first, each to the process given the fewest bytes so far: at most 1/N of the model plus one
    tensor each).

    The processes gather the parameters one at a time (a collective: every process must call this, with the same
    model), so a process holds its partitions, its share (about 1/N of the model) and one gathered parameter, never the
    model whole. A parameter an optimizer steps is gathered from its fp32 master partitions (DeepSpeed's
    `safe_get_full_fp32_param`) and kept in the module's dtype: the 16-bit weights under bf16 or fp16, as DeepSpeed's
    `_zero3_consolidated_16bit_state_dict`, which Accelerate's `get_state_dict` writes, has them; any other parameter
    from its partitions (`compat.zero3_full`). Tied parameters (one tensor under two names) go to one
    process under both names, which `save_model` writes once."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from ..compat import zero3_full

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    state = model.state_dict(keep_vars=True)
    unique = {id(tensor): tensor for tensor in state.values()}
    owners = _owners({key: math.prod(getattr(t, "ds_shape", t.shape)) * t.element_size() for key, t in unique.items()},
                     size)  # fmt: skip
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, tensor in unique.items():  # every process in the same order, so the gathers meet
            owner = owners[key]
            # A trained parameter from its fp32 master partitions, in the module's dtype (what DeepSpeed copies into
            # the module's partitions after each step): not this process's whole copy of a parameter ZeRO-3 keeps
            # whole everywhere (`ds_persist`, the small ones), which GatheredParameters reads as it is and which
            # DeepSpeed 0.19.0 was seen to leave stale after a step on one of two CPU processes.
            master = safe_get_full_fp32_param(tensor) if hasattr(tensor, "_z3_optimizer") else None
            if master is not None:
                if owner == rank:
                    copies[key] = master.to("cpu", dtype=tensor.dtype, copy=True)
            elif hasattr(tensor, "ds_id"):  # (no optimizer holds it: a frozen parameter, a model without an engine)
                whole = zero3_full(tensor)
                if owner == rank:
                    copies[key] = whole.to("cpu", copy=True)
            elif owner == rank:
                copies[key] = tensor.detach().to("cpu", copy=True)
    return {name: copies[id(tensor)] for name, tensor in state.items() if id(tensor) in copies}


def _owners(sizes: dict, size: int) -> dict:
    """{key: the process (of `size`) that keeps it}: the largest first, each to the process given the fewest bytes so
    far (at most 1/size of the total plus one tensor each). The same on every process given `sizes` in the same
    order (a stable sort)."""
    loads = [0] * size
    owners = {}
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        owners[key] = min(range(size), key=loads.__getitem__)
        loads[owners[key]] += sizes[key]
    return owners


def zero3_training_state(engine, group=None) -> dict:
    """This process's share of a DeepSpeed ZeRO-3 engine's training state under the model's names, for a DCP
    checkpoint that any layout resumes (`hf_p2r.training.dcp`): {"model": {name: fp32 master weights}, "optimizer":
    {name: {"step", and the optimizer's state keys (AdamW's exp_avg, exp_avg_sq)}}}, each whole tensor kept (a CPU
    copy) by one process of `group` (`_owners`, balanced by size), as one process's torch AdamW holds it. The
    processes gather one parameter's values at a time (DeepSpeed's `safe_get_full_fp32_param` /
    `safe_get_full_optimizer_state`, collectives: call on every process), so none holds the model whole. A tied head is
    saved once, under the embeddings' name (`named_parameters`)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ..compat import zero3_optimizer_states

    rank = dist.get_rank(group)
    params, owners = _parameter_owners(engine, group)
    first = next(iter(params.values()))
    keys = sorted(key for key in zero3_optimizer_states(engine.optimizer, first) if key != "step")  # none before a step
    model, optimizer = {}, {}
    with torch.no_grad():
        for name, param in params.items():  # every process in the same order, so the gathers meet
            mine = owners[name] == rank
            weights = safe_get_full_fp32_param(param)
            values = {key: safe_get_full_optimizer_state(param, key) for key in keys}
            if mine:
                model[name] = weights.to("cpu", copy=True)
                if keys:
                    step = zero3_optimizer_states(engine.optimizer, param)["step"]
                    optimizer[name] = {key: value.to("cpu", copy=True) for key, value in values.items()}
                    optimizer[name]["step"] = torch.as_tensor(step, dtype=torch.float32).to("cpu", copy=True)
    return {"model": model, "optimizer": optimizer}


def zero3_owned_names(engine, group=None) -> list[str]:
    """The parameters whose whole values this process keeps in `zero3_training_state` (and loads for
    `set_zero3_training_state`)."""
    import torch.distributed as dist

    params, owners = _parameter_owners(engine, group)
    return [name for name in params if owners[name] == dist.get_rank(group)]


def _parameter_owners(engine, group=None) -> tuple[dict, dict]:
    """(a ZeRO-3 engine's parameters by name, {name: the process of `group` that keeps it whole}), balanced by size."""
    import torch.distributed as dist

    params = dict(engine.module.named_parameters())
    return params, _owners({name: param.ds_numel for name, param in params.items()}, dist.get_world_size(group))


def zero3_shapes(engine) -> dict[str, tuple[int, ...]]:
    """{name: the whole shape} of a ZeRO-3 engine's parameters (each process holds a flat partition)."""
    return {name: tuple(param.ds_shape) for name, param in engine.module.named_parameters()}


def set_zero3_training_state(engine, state: dict, group=None) -> None:
    """Load `state` (`zero3_training_state`'s layout: this process's share of the whole tensors, under
    `zero3_owned_names`) into a DeepSpeed ZeRO-3 engine: one parameter at a time, its owner broadcasts each value and
    every process writes its partition of the fp32 master weights and of the optimizer state (created first where the
    optimizer has not stepped yet), then the model's own partitions are copied from the fp32 ones. Call on every
    process."""
    import torch.distributed as dist

    from ..compat import (
        zero3_copy_fp32_to_partitions,
        zero3_optimizer_states,
        zero3_set_full,
        zero3_start_optimizer_states,
    )

    optimizer = engine.optimizer
    if getattr(optimizer, "swap_optimizer", False):
        raise ValueError("checkpoint_format: dcp does not load into DeepSpeed's NVMe-offloaded optimizer state")
    rank = dist.get_rank(group)
    params, owners = _parameter_owners(engine, group)
    # The optimizer's state keys (the same in every share: DCP's metadata; a process may keep no parameter)
    held = next(iter(state["optimizer"].values()), None)
    mine = None if held is None else sorted(key for key in held if key != "step")
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    state_keys = next((found for found in everyone if found is not None), [])
    keys = [None, *state_keys]  # the fp32 weights, then the optimizer's state
    if state_keys:
        zero3_start_optimizer_states(optimizer, state_keys)
    with torch.no_grad():
        for name, param in params.items():
            source, device = owners[name], param.ds_tensor.device
            for key in keys:
                if rank == source:
                    value = (state["model"][name] if key is None else state["optimizer"][name][key]).to(device)
                else:
                    value = torch.empty(tuple(param.ds_shape), dtype=torch.float32, device=device)
                dist.broadcast(value, group_src=source, group=group)
                zero3_set_full(optimizer, param, value, key)
            if state_keys:
                step = torch.as_tensor(state["optimizer"][name]["step"] if rank == source else 0.0,
                                       dtype=torch.float32).to(device)  # fmt: skip
                dist.broadcast(step, group_src=source, group=group)
                zero3_optimizer_states(optimizer, param)["step"] = step.cpu()
    zero3_copy_fp32_to_partitions(optimizer)


def _copy_buffers(source: nn.Module, target: nn.Module, device: torch.device | str | None = None) -> None:
    """Give `target` copies of `source`'s buffers (the rotary tables, which meta-device construction leaves empty)."""
    for name, buffer in source.named_buffers():
        owner, _, leaf = name.rpartition(".")  # assigning a registered buffer's name replaces it, persistence kept
        setattr(target.get_submodule(owner), leaf, buffer.detach().to(device or buffer.device, copy=True))


def _layout(tensor: torch.Tensor) -> str:
    placements = getattr(tensor, "placements", None)
    return f"placements={placements}, local shape={tuple(local_tensor(tensor).shape)}"


__all__ = [
    "delink_deepspeed",
    "delink_fully_sharded",
    "fully_shard_p2r",
    "gather_deepspeed_model",
    "gather_shared_once",
    "materialize_zero3",
    "partition_zero3",
    "set_zero3_training_state",
    "zero3_owned_names",
    "zero3_owned_state",
    "zero3_shapes",
    "zero3_training_state",
    "zero3_units",
]
