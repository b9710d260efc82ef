"""DeepSpeed for P2R models: ZeRO-3 partitions built from the meta device one module at a time, the delink of a
DeepSpeed engine's model, and each process's share of the whole tensors for saves and DCP resume checkpoints.

`partition_zero3` turns a meta-device model into ZeRO-3 partitions one module at a time (what `deepspeed.zero.Init`
does for a model built inside it), `materialize_zero3` with the layout-independent initialisation
(`hf_p2r.distributed.materialize`); `delink_deepspeed` delinks a DeepSpeed engine's model (ZeRO-3: straight into the
new model's partitions), `gather_deepspeed_model` copies it whole; `zero3_owned_state` gives each process its share of
the whole tensors, one gathered parameter at a time, for `save_model_from_shards`; `zero3_training_state` /
`set_zero3_training_state` do the same with the fp32 master weights and the optimizer state, for DCP resume
checkpoints any layout reads (`hf_p2r.training.resume.dcp`).

DeepSpeed itself is imported inside the functions that use it, never by importing this module: its import logs
"Setting accelerator to CPU" on a machine without a GPU and takes seconds, which a run that does not use it should not
pay (`tests/distributed/test_deepspeed_import.py`).
"""

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models.p2r import DelinkPlan, P2RPreTrainedModel
from ..models.p2r.sharing_p2r import delink_names
from .materialize import copy_buffers, delinked_config, materialize


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
    copy_buffers(module, model, device="cpu")
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


def delink_deepspeed(engine, num_unique_layers: int | DelinkPlan | None = None) -> nn.Module:
    """The delinked copy of a DeepSpeed engine's P2R model, for a new engine (`deepspeed.initialize` or
    `accelerator.prepare`, with a new optimizer: DeepSpeed's flat ZeRO partitions have no per-parameter state to carry).
    Every rank must call it (it gathers).

    The delink is `model.delink`'s: `num_unique_layers` blocks (None: the real model) or a `DelinkPlan`
    (`engine.module.delink_plan(k, num_hidden_layers=L', growth=..., function_preserving=...)`), depth growth included.

    Under ZeRO-3 (partitioned parameters) the new model is built on the meta device with the config after the delink
    (`plan.fields`) and partitioned by `partition_zero3` with the old parameters' settings (`like`), each new module
    filled from the full fp32 master weights of the old parameters it copies (`safe_get_full_fp32_param`, one
    parameter at a time), started as the plan says (`DelinkPlan.start_copy`: function-preserving growth's zeroed and
    scaled residual outputs), so no process holds either model whole. Under ZeRO-1/2 every process holds the model
    anyway: `gather_deepspeed_model(engine).delink(plan)`.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    plan = module.delink_plan(num_unique_layers)  # a delink that cannot be is refused before anything is gathered
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        return gather_deepspeed_model(engine).delink(plan)
    parameter_map = module.delink_parameter_map(plan)
    old_parameters, old_buffers = dict(module.named_parameters()), dict(module.named_buffers())
    buffer_map = delink_names(old_buffers, list(plan.sources))
    with torch.device("meta"):
        new_model = type(module)(delinked_config(module.config, plan))
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
                        plan.start_copy(prefix + key, whole)
                        placed[id(param)] = nn.Parameter(whole, requires_grad=source.requires_grad)
                    setattr(sub, key, placed[id(param)])
                for key, _ in sub.named_buffers(recurse=False):
                    setattr(sub, key, old_buffers[buffer_map[prefix + key]].detach().to("cpu", copy=True))

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
    checkpoint that any layout resumes (`training.resume.dcp`): {"model": {name: fp32 master weights}, "optimizer":
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


__all__ = [
    "delink_deepspeed",
    "gather_deepspeed_model",
    "materialize_zero3",
    "partition_zero3",
    "set_zero3_training_state",
    "zero3_owned_names",
    "zero3_owned_state",
    "zero3_shapes",
    "zero3_training_state",
    "zero3_units",
]
