"""Meta-device construction: a model built on the meta device (no memory) and materialised only where a process holds
it, with values that do not depend on the layout.

Every module is initialised by the model's own `_init_weights` (transformers' initialisation, as `post_init` runs it)
under a seed derived from the run's seed and the module's name in the model (`module_seed`), on the CPU, one module
at a time. So a tensor's values depend only on (seed, name): one process that holds the whole model, a pipeline
stage that holds a few blocks, and an FSDP2 process that keeps a shard of each tensor all see the same numbers (bitwise
on the CPU). A module's buffers are initialised the same way (the rotary tables: transformers' `_init_weights`
recomputes `inv_freq` from the config), so nothing is copied from a model that was never built.

```python
>>> with torch.device("meta"):
...     model = P2RForCausalLM(config)
>>> materialize(model, seed=42)                       # the whole model (one process, DDP)
>>> materialize(model, seed=42, keep=stage_modules)   # a pipeline stage's modules only
>>> fully_shard_p2r(model, mesh=mesh); model.to_empty(device="cuda"); materialize(model, seed=42)  # FSDP2 shards
```

A delinked (or grown) model held in pieces is built on the meta device too, with `delinked_config`, and filled from
the old model's pieces instead (`delink_fully_sharded`, `delink_deepspeed`, `delink_stages`); `copy_buffers` gives it
the old model's buffers.
"""

import copy
import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from ..compat import init_module_weights, local_tensor
from ..models.p2r.sharing_p2r import LAYER_KEY, DelinkPlan


def module_seed(seed: int, name: str) -> int:
    """The seed a module named `name` (its name in the whole model, e.g. `model.layers.3.mlp.down_proj`) is
    initialised under in a run seeded `seed`: the same on every process and in every layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def materialize(
    model: PreTrainedModel,
    seed: int,
    *,
    keep: Iterable[nn.Module] | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Allocate and initialise, in place, the tensors of `model` (built on the meta device) that this process holds:
    those of `keep`'s modules and their submodules (None: the whole model). Returns the bytes this process allocated.

    Each module's tensors are initialised in full on the CPU by the model's `_init_weights(module)` under
    `module_seed(seed, name)`; a tensor still on the meta device is then placed on `device`, and a sharded one
    (a DTensor: FSDP2 units after `fully_shard` and `to_empty`) receives its local shard, so no process ever holds more
    than one module's full tensors beside its own. A parameter tied to another module's (a head tied to the
    embeddings) is initialised once, by the module that owns it (the first to name it), and stays tied. Modules
    outside `keep` stay on the meta device. A tensor that `_init_weights` leaves unset is a `ValueError`.
    """
    device = torch.device(device)
    modules = dict(model.named_modules())
    held = set(map(id, modules.values())) if keep is None else {id(sub) for root in keep for sub in root.modules()}
    # Every parameter slot (module, key) under the name of the tensor it is: a tied one (the model's tied keys, or the
    # same tensor under a second name) under the name that owns it.
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    first_name: dict[int, str] = {}
    slots: dict[str, list[tuple[nn.Module, str]]] = {}  # owning name -> the held slots that take its tensor
    needed: dict[str, None] = {}  # owning modules to initialise, in the model's order
    for module_name, module in modules.items():
        for key, param in module.named_parameters(recurse=False, remove_duplicate=False):
            name = _join(module_name, key)
            owning = tied.get(name, first_name.setdefault(id(param), name))
            if id(module) in held:
                slots.setdefault(owning, []).append((module, key))
                needed[owning.rpartition(".")[0]] = None
        if id(module) in held and any(True for _ in module.buffers(recurse=False)):
            needed[module_name] = None
    initialisers = {name: module for name, module in modules.items() if isinstance(module, PreTrainedModel)}

    allocated = 0
    order = {name: index for index, name in enumerate(modules)}
    for module_name in sorted(needed, key=order.get):
        module = modules[module_name]
        own = [key for key, _ in module.named_parameters(recurse=False, remove_duplicate=False)]
        if any(tied.get(_join(module_name, key), _join(module_name, key)) != _join(module_name, key) for key in own):
            raise ValueError(f"materialize: {module_name} holds a parameter tied to another module's beside its own")
        buffers = [key for key, _ in module.named_buffers(recurse=False)] if id(module) in held else []
        originals = {key: getattr(module, key) for key in own + buffers}
        for key, tensor in originals.items():  # the module's whole tensors on the CPU, NaN until initialised
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            full = full.fill_(float("nan")) if full.is_floating_point() else full.zero_()
            # (Assigning a registered buffer's or parameter's name replaces it, its kind and persistence kept.)
            setattr(module, key, full if key in buffers else nn.Parameter(full, requires_grad=tensor.requires_grad))
        initialiser = initialisers[max((n for n in initialisers if _within(module_name, n)), key=len)]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(module_seed(seed, module_name))
            init_module_weights(initialiser, module)
        for key, original in originals.items():
            value = getattr(module, key)
            if value.is_floating_point() and torch.isnan(value).any():
                raise ValueError(
                    f"materialize: {_join(module_name, key)} is not initialised by {type(initialiser).__name__}"
                )
            setattr(module, key, original)  # the owner stays as it was unless it holds the tensor itself
            if key in buffers:
                targets = [(module, key, True)]
            else:
                targets = [(slot, slot_key, False) for slot, slot_key in slots.get(_join(module_name, key), [])]
            placed = None  # the one materialised tensor every meta slot of this name takes (ties kept)
            filled: set[int] = set()  # sharded tensors filled (a tied one sits in two slots)
            for slot, slot_key, is_buffer in targets:
                tensor = getattr(slot, slot_key)
                if isinstance(tensor, DTensor):  # a shard: this process's part of the full tensor
                    if id(tensor) in filled:
                        continue
                    if local_tensor(tensor).is_meta:
                        raise ValueError(
                            f"materialize: {_join(module_name, key)} is sharded on the meta device: allocate the "
                            "shards first (model.to_empty(device=...) after fully_shard)"
                        )
                    filled.add(id(tensor))
                    shard = distribute_tensor(value.detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
                    local_tensor(tensor).copy_(shard.to_local())
                    allocated += local_tensor(tensor).nbytes
                elif tensor.is_meta:
                    if placed is None:
                        placed = value.detach().to(device)
                        placed = placed if is_buffer else nn.Parameter(placed, requires_grad=tensor.requires_grad)
                        allocated += placed.nbytes
                    setattr(slot, slot_key, placed)
                else:  # allocated already (`to_empty`: e.g. the buffers of FSDP2 units): filled in place
                    tensor.copy_(value)
                    allocated += tensor.nbytes
    return allocated


def materialized_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers that are allocated (not on the meta device), each tensor once; a
    sharded tensor counts its local shard."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        local = local_tensor(tensor)
        if id(tensor) not in seen and not local.is_meta:
            seen.add(id(tensor))
            total += local.nbytes
    return total


def delinked_config(config, plan: DelinkPlan):
    """A copy of `config` as the model is after the delink `plan` (its `fields`: depth, blocks, sharing), to build the
    delinked model on the meta device and fill it from the old one's pieces (FSDP2 shards, ZeRO-3 partitions)."""
    new_config = copy.deepcopy(config)
    for key, value in plan.fields.items():
        setattr(new_config, key, value)
    return new_config


def copy_buffers(
    source: nn.Module, target: nn.Module, sources: Sequence[int] | None = None, device: torch.device | str | None = None
) -> None:
    """Give `target` (built on the meta device) copies of `source`'s buffers (the rotary tables), by name; a layer's
    from the block it copies when `target` is `source` delinked (`sources`: the old block of each new block)."""
    for name, _ in target.named_buffers():
        match = LAYER_KEY.match(name) if sources is not None else None
        old = f"{match['prefix']}{sources[int(match['block'])]}.{match['rest']}" if match else name
        buffer = source.get_buffer(old)
        owner, _, leaf = name.rpartition(".")  # assigning a registered buffer's name replaces it, persistence kept
        setattr(target.get_submodule(owner), leaf, buffer.detach().to(device or buffer.device, copy=True))


def _join(module_name: str, key: str) -> str:
    return f"{module_name}.{key}" if module_name else key


def _within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


__all__ = ["copy_buffers", "delinked_config", "materialize", "materialized_bytes", "module_seed"]
