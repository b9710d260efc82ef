"""Where granular offload puts a model's tensors: each offloaded block's parameters in one host allocation (pinned
when the compute device is CUDA) beside the copies sent to the device and the buffers gradients land in, every other
parameter and every buffer on the compute device, and back where they came from on `remove()`. Also the check that
no other engine places the same parameters (DDP, FSDP, tensor parallelism)."""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...compat import tensor_version
from .estimates import ALIGN, decoder_layers, slab_bytes, slab_specs, unique

__all__ = ["Block", "Placement", "alloc", "check_supported", "free", "slab"]


def check_supported(model: nn.Module) -> None:
    """Granular offload is single-process and owns its blocks' placement: refuse engines that also own it."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        raise ValueError(
            "granular offload does not compose with DistributedDataParallel/DataParallel (its gradient hooks and "
            "buckets assume device-resident parameters); for several GPUs use FSDP2 CPUOffloadPolicy or DeepSpeed "
            "ZeRO-Offload instead"
        )
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FSDPModule | FullyShardedDataParallel) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    ):
        raise ValueError(
            "granular offload does not compose with FSDP or tensor parallelism (they shard and place the same "
            "parameters); use FSDP2's CPUOffloadPolicy for offload under FSDP"
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"granular offload runs in a single process, but torch.distributed has {dist.get_world_size()} ranks; "
            "for several GPUs use FSDP2 CPUOffloadPolicy or DeepSpeed ZeRO-Offload"
        )


def alloc(tensor: torch.Tensor) -> None:
    """Give `tensor` its storage back (FSDP2's technique: `untyped_storage().resize_`)."""
    storage = tensor.untyped_storage()
    if storage.size() != tensor.numel() * tensor.element_size():
        storage.resize_(tensor.numel() * tensor.element_size())


def free(tensor: torch.Tensor) -> None:
    """Release `tensor`'s storage; views of it (saved for backward) stay valid views, refilled by `alloc`."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def slab(specs: list[tuple], pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host allocation (pinned if `pin`) and a tensor per (shape, dtype) of `specs` laid out in it.

    Pinning it whole costs one power-of-two rounding per block instead of one per tensor. Each tensor gets a storage
    of its own (a slice of the allocation's storage, which keeps the allocation alive): `state_dict()` consumers that
    drop or clone tensors sharing a storage (safetensors, Accelerate's `save_state`) see distinct tensors.
    """
    allocation = torch.empty(slab_bytes(specs), dtype=torch.uint8, pin_memory=pin)
    storage, offset, tensors = allocation.untyped_storage(), 0, []
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(torch.empty(0, dtype=dtype).set_(storage[offset : offset + nbytes]).view(shape))
        offset += -(-nbytes // ALIGN) * ALIGN
    return allocation, tensors


def _check_materialized(model: nn.Module) -> None:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if meta := next((name for name, tensor in tensors if tensor.is_meta), None):
        raise ValueError(f"offload: {meta} is on the meta device: materialize the model, or pass `materialize`")


def _outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The largest modules of `model` that hold none of `blocks` (what stays resident when `blocks` are offloaded)."""
    inside = {id(sub) for block in blocks for sub in block.modules()}
    holding = {id(module) for module in model.modules() if any(id(sub) in inside for sub in module.modules())}
    found, covered = [], set()
    for module in model.modules():  # parents before their children
        if id(module) not in holding and id(module) not in covered:
            found.append(module)
            covered.update(id(sub) for sub in module.modules())
    return found


@dataclass(eq=False)
class Block:
    """One offloaded block: its parameters, their CPU masters and their device working tensors."""

    index: int
    params: list[nn.Parameter]
    slab: torch.Tensor  # the block's one host allocation: masters, sources and staging are laid out in it
    masters: list[torch.Tensor]
    works: list[torch.Tensor]  # storage allocated only while the block is fetched
    # What is copied to the device: the master, or with `compute_dtype` a CPU copy in that dtype (half the transfer),
    # refreshed after any optimizer step (torch's fused AdamW does not bump version counters) and when the
    # parameter's version counter shows another in-place update (load_state_dict, ...).
    sources: list[torch.Tensor] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)  # where each gradient lands on the host
    versions: list[int] = field(default_factory=list)
    fetched: bool = False
    ready: bool = False  # the compute stream has waited for the copy
    event: torch.Event | None = None  # copy to the device done
    origins: list[torch.device] = field(default_factory=list)
    # `update="delayed"`: the copies the update running now writes, swapped with `sources` (and sent from then on)
    # once it is done (`swap_pending` until then).
    next_sources: list[torch.Tensor] = field(default_factory=list)
    swap_pending: bool = False


class Placement:
    """`GranularOffload`'s placement: `_place` moves the tensors in, `_set_data` points a parameter at new data, and
    `_unplace` (from `remove`) puts everything back."""

    def _place(self, pin: bool, materialize=None) -> None:
        blocks = decoder_layers(self.model)
        if materialize is None:
            _check_materialized(self.model)
        if materialize is not None:  # a model on the meta device: the resident modules materialised on the device
            resident = _outside(self.model, [blocks[i] for i in self.layers])
            materialize(resident, self.device)
            # `remove` puts them on the CPU, where a model without offload lives, as it does a model placed from there.
            host = torch.device("cpu")
            self._moved += [(p, host) for p in unique(p for module in resident for p in module.parameters())]
            self._moved_buffers += [
                (module, name, buffer.to(host))
                for root in resident
                for module in root.modules()
                for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False)
            ]
        delayed = self.update == "delayed"
        for i in self.layers:
            if materialize is not None:  # each offloaded block on the CPU, then copied into its slab before the next
                materialize([blocks[i]], torch.device("cpu"))
            params = unique(blocks[i].parameters())
            staging_dtype = (self.accumulation_dtype or params[0].dtype) if self.grad_accumulation == "device" else None
            specs = slab_specs(params, self.compute_dtype, staging_dtype, delayed=delayed)
            allocation, tensors = slab(specs, pin)
            n = len(params)
            masters, converted, staging = tensors[:n], tensors[n:-n], tensors[-n:]
            block = Block(i, params, allocation, masters, [], staging=staging, origins=[p.device for p in params])
            if delayed:
                converted, block.next_sources = converted[:n], converted[n:]
            converted = iter(converted)
            for p, master in zip(params, masters):
                master.copy_(p.detach())
                work = torch.empty(p.shape, dtype=self.compute_dtype or p.dtype, device=self.device)
                free(work)
                self._set_data(p, master)
                # `delayed`: always a copy of its own, as the update writes the masters while a step sends it.
                source = master if work.dtype == master.dtype and not delayed else next(converted).copy_(master)
                block.works.append(work)
                block.sources.append(source)
                block.versions.append(tensor_version(p))
            self._blocks[i] = block
        # {parameter: (master, staging buffer)} for the gradient path; {parameter: (block, index)}.
        self._host = {p: (m, s) for b in self._blocks.values() for p, m, s in zip(b.params, b.masters, b.staging)}
        self._where = {p: (b, i) for b in self._blocks.values() for i, p in enumerate(b.params)}
        _check_materialized(self.model)
        offloaded = {id(p) for i in self.layers for p in blocks[i].parameters()}
        for p in unique(self.model.parameters()):
            if id(p) not in offloaded and p.device != self.device:
                self._moved.append((p, p.device))
                self._set_data(p, p.data.to(self.device))
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if buffer.device != self.device:
                    self._moved_buffers.append((module, name, buffer))
                    setattr(module, name, buffer.to(self.device))  # a registered buffer: replaced, persistence kept

    @staticmethod
    def _set_data(p: nn.Parameter, data: torch.Tensor) -> None:
        """Point `p` at `data`, carrying its gradient along (the `.grad` setter checks device and dtype)."""
        grad, p.grad = p.grad, None
        p.data = data
        if grad is not None:
            p.grad = grad.to(device=data.device, dtype=data.dtype)

    def _unplace(self) -> None:
        """Every parameter and buffer back on the device it came from (the same objects)."""
        while self._blocks:  # block by block: each slab is freed before the next block is copied out
            _, block = self._blocks.popitem()
            for p, master, origin in zip(block.params, block.masters, block.origins):
                # A copy even on the CPU: out of the (pinned) slab, which also holds the block's buffers.
                self._set_data(p, master.to(origin, copy=True))
            del block
        for p, origin in self._moved:
            self._set_data(p, p.data.to(origin))
        for module, name, buffer in self._moved_buffers:
            setattr(module, name, buffer)
        self._moved, self._moved_buffers = [], []
