"""Granular CPU offload for training (M6-10T's second technique): chosen decoder layers live in CPU memory.

`GranularOffload(model, layers)` is applied to a model from outside; the model code knows nothing about it. The
parameters of the chosen blocks (`model.model.layers[i]`), their gradients and their optimizer state live in CPU
memory (parameters and gradients pinned when the compute device is CUDA, so their copies are asynchronous; the
optimizer state is never copied); every other parameter stays on the compute device. While the model
runs, each offloaded block is copied to the compute device just before it is needed (on a side stream, `prefetch`
positions ahead in execution order, so the copy overlaps compute) and its device copy is released after use;
gradients go back to CPU on another side stream as soon as autograd has accumulated them. The optimizer step of the
offloaded parameters runs on the CPU, after the device step of the resident ones has been launched.

    offload = GranularOffload(model, layers=0.5, device="cuda")   # or [1, 3, 5, 7], or "auto" with a budget
    optimizer = offload.build_optimizer(lr=3e-4, weight_decay=0.1)
    for batch in batches:
        model(**batch).loss.backward()              # offloaded .grad are CPU tensors after backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    offload.remove()                                # hooks gone, every parameter back where it was

How: the same `Parameter` objects are trained. Between training steps `p.data` is the CPU master tensor, so the
optimizer, `state_dict()` and `save_pretrained` see ordinary CPU parameters. From the start of a forward to the end
of its backward, `p.data` is a device tensor whose storage is allocated only while the block is fetched (FSDP2's
technique: `untyped_storage().resize_`), so the tensors autograd saves for backward (views of the weights) stay
valid views that are refilled before the block's backward and recomputation, and hold no memory in between. Keeping
`p.data` on the device for the whole window also keeps one gradient accumulator per parameter, so a shared block of a
pseudo model gets one gradient per backward, after its last use (with gradient accumulation, each micro-batch's
gradient is added to the CPU `.grad`). With no CUDA device, storage and compute device are both the CPU: the copies
are CPU to CPU and every other step runs unchanged.

Limits: one process (no DDP/FSDP/tensor parallelism: they raise `ValueError`); weights written through `p.data`
between steps are not seen by the `compute_dtype` copies (use `p.copy_` or an optimizer step, which are).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = [
    "GranularOffload",
    "decoder_layers",
    "estimate_device_bytes",
    "execution_order",
    "measure_activation_bytes",
    "select_layers",
    "spread_layers",
]

# Fraction of the device's memory that `layers="auto"` plans for when no budget is given: the estimate leaves out
# the allocator's fragmentation, CUDA context and the peak of one block's recomputation.
DEFAULT_BUDGET_FRACTION = 0.85

LayerSpec = str | float | Sequence[int] | None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's blocks, `model.base_model.layers` (`model.model.layers` for P2R and Llama)."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `base_model.layers` ModuleList: granular offload needs a decoder whose "
            "blocks are `model.model.layers` (P2R, Llama and most transformers decoders)"
        )
    return layers


def execution_order(model: nn.Module) -> list[int]:
    """The block run at each depth, in forward order: `config.block_of_depth` for a P2R model (a shared block of a
    pseudo model comes back at several depths), `0..n-1` for other decoders."""
    order = getattr(getattr(model, "config", None), "block_of_depth", None)
    return list(order) if order is not None else list(range(len(decoder_layers(model))))


def spread_layers(count: int, num_blocks: int) -> list[int]:
    """`count` of `num_blocks` block indices, evenly spaced and ending at the last block.

    Spacing lets each offloaded block's copy overlap the compute of the resident blocks before it; the first blocks
    are offloaded last because nothing runs before them in forward to hide their copy.

    >>> spread_layers(4, 8), spread_layers(2, 8), spread_layers(3, 8)
    ([1, 3, 5, 7], [3, 7], [2, 5, 7])
    """
    return sorted(num_blocks - 1 - (i * num_blocks) // count for i in range(count))


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(p): p for p in params}.values())


def _state_bytes(params: Sequence[torch.Tensor], optimizer_states: int) -> int:
    """Device bytes of resident parameters in training: the parameter, and for a trainable one its gradient and the
    optimizer's state tensors (AdamW: 2), all in the parameter's dtype."""
    return sum(p.numel() * p.element_size() * (1 + (1 + optimizer_states) * p.requires_grad) for p in params)


def estimate_device_bytes(
    model: nn.Module,
    offloaded: Iterable[int],
    *,
    activation_bytes: int = 0,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
    optimizer_states: int = 2,
) -> int:
    """Device bytes of training `model` with the blocks `offloaded` in CPU memory.

    Resident parameters cost parameter + gradient + `optimizer_states` tensors each (16 bytes per fp32 parameter with
    AdamW). Offloaded blocks cost only their working set: up to `prefetch + 2` blocks' weights in flight (the block
    running, the ones prefetched, one being released) plus one block's gradients before they reach the CPU.
    `activation_bytes` (see `measure_activation_bytes`) is added as given; it does not depend on offload.
    """
    blocks = [_unique(layer.parameters()) for layer in decoder_layers(model)]
    offloaded = sorted(set(offloaded))
    in_blocks = {id(p) for params in blocks for p in params}
    others = [p for p in _unique(model.parameters()) if id(p) not in in_blocks]
    total = _state_bytes(others, optimizer_states) + activation_bytes
    total += sum(_state_bytes(params, optimizer_states) for i, params in enumerate(blocks) if i not in offloaded)
    if offloaded:
        block_bytes = max(sum(p.numel() * (compute_dtype or p.dtype).itemsize for p in blocks[i]) for i in offloaded)
        total += (min(prefetch + 2, len(offloaded)) + 1) * block_bytes
    return total


def measure_activation_bytes(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one training forward of `input_ids` (as labels too), parameters
    excluded: what a training step holds on the device besides the training state.

    Run it under the autocast and activation-checkpointing settings of the training run, before offload is applied
    (a pseudo model's activations equal its real model's: same depth, same shapes). Under activation checkpointing it
    counts the checkpointed inputs, not the transient peak of one block's recomputation.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    del loss
    return sum(saved.values())


def select_layers(
    model: nn.Module,
    layers: LayerSpec,
    *,
    budget_bytes: int | None = None,
    activation_bytes: int = 0,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
) -> list[int]:
    """The block indices (into `model.model.layers`) to offload, sorted.

    `layers` is one of:
      - a list of block indices, e.g. `[1, 3, 5, 7]`;
      - a ratio of blocks (a float in [0, 1]): `round(ratio * num_blocks)` blocks spread by `spread_layers`;
      - `"auto"`: the fewest blocks (spread the same way) with which `estimate_device_bytes` fits `budget_bytes`;
      - `None`: no block.
    Indices refer to blocks, not depths: a shared block of a pseudo model counts once and is offloaded or not at all
    of its depths. Embeddings, the final norm and the LM head always stay on the device.
    """
    num_blocks = len(decoder_layers(model))
    if layers is None:
        return []
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f"offload: expected 'auto', a ratio or a list of block indices, got the string {layers!r}")
        if budget_bytes is None:
            raise ValueError("offload: 'auto' needs budget_bytes (the device memory to plan for)")
        estimate = partial(
            estimate_device_bytes,
            model,
            activation_bytes=activation_bytes,
            prefetch=prefetch,
            compute_dtype=compute_dtype,
        )
        for count in range(num_blocks + 1):
            if (need := estimate(spread_layers(count, num_blocks))) <= budget_bytes:
                return spread_layers(count, num_blocks)
        raise ValueError(
            f"offload: 'auto': training needs an estimated {need / 2**30:.2f} GiB of device memory even with all "
            f"{num_blocks} blocks offloaded, more than the budget of {budget_bytes / 2**30:.2f} GiB (reduce the batch "
            "or sequence length, or turn on activation checkpointing)"
        )
    if isinstance(layers, float):
        if not 0.0 <= layers <= 1.0:
            raise ValueError(f"offload: a ratio must be between 0 and 1, got {layers}")
        return spread_layers(int(layers * num_blocks + 0.5), num_blocks)
    if isinstance(layers, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        if bad := [i for i in layers if not 0 <= i < num_blocks]:
            raise ValueError(f"offload: block indices {bad} out of range: the model has blocks 0..{num_blocks - 1}")
        return sorted(set(layers))
    raise ValueError(
        f"offload: expected 'auto', a ratio (a float such as 0.5) or a list of block indices, got {layers!r}"
    )


def _check_supported(model: nn.Module) -> None:
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


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != tensor.numel() * tensor.element_size():
        storage.resize_(tensor.numel() * tensor.element_size())


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _grad_tensor(output) -> torch.Tensor | None:
    """The first tensor in a block's output that autograd will send a gradient to."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else ()
    return next((t for t in map(_grad_tensor, values) if t is not None), None)


@dataclass(eq=False)
class _Block:
    """One offloaded block: its parameters, their CPU masters and their device working tensors."""

    index: int
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    works: list[torch.Tensor]  # storage allocated only while the block is fetched
    # What is copied to the device: the master, or with `compute_dtype` a CPU copy in that dtype (half the transfer),
    # refreshed after any optimizer step (torch's fused AdamW does not bump version counters) and when the
    # parameter's version counter shows another in-place update (load_state_dict, ...).
    sources: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    fetched: bool = False
    ready: bool = False  # the compute stream has waited for the copy
    event: torch.Event | None = None  # copy to the device done
    origins: list[torch.device] = field(default_factory=list)


class GranularOffload:
    """Offload the chosen blocks of `model` to CPU memory for training; see the module docstring.

    Args:
        model: a decoder with blocks at `model.model.layers` (P2R, Llama, ...), in one process (no DDP/FSDP/TP).
        layers: which blocks, see `select_layers`: indices, a ratio, "auto", or None.
        device: the compute device. Resident parameters and all buffers are moved there; offloaded parameters are
            moved to (pinned) CPU memory. Default: the device of the model's first parameter.
        prefetch: how many positions ahead in execution order (forward, then backward) blocks are copied.
        compute_dtype: dtype of the device working copies of offloaded weights (e.g. `torch.bfloat16` under bf16
            autocast, like FSDP2's `MixedPrecisionPolicy(param_dtype=...)`: autocast then has nothing to cast and
            cache, and their gradients come back in that dtype and are accumulated in the master dtype). Default:
            the parameter's dtype.
        budget_bytes, activation_bytes: for `layers="auto"` (see `select_layers`); on CUDA the budget defaults to
            85% of the device's memory.

    Apply it after the model has its final structure and placement (after `accelerator.prepare(model)`, after
    `delink`); do not move the model while it is applied (`remove()` first). Build the optimizer after applying it.
    Between a training forward and the end of its backward, offloaded parameters hold device tensors that are empty
    except while their block runs: read weights after backward (or after a `torch.no_grad()` forward).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSpec,
        *,
        device: str | torch.device | None = None,
        prefetch: int = 1,
        compute_dtype: torch.dtype | None = None,
        budget_bytes: int | None = None,
        activation_bytes: int = 0,
    ):
        _check_supported(model)
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"offload: compute device must be cpu or cuda, got {self.device}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"offload: prefetch must be a non-negative integer, got {prefetch!r}")
        if layers == "auto" and budget_bytes is None and self.device.type == "cuda":
            budget_bytes = int(DEFAULT_BUDGET_FRACTION * torch.cuda.get_device_properties(self.device).total_memory)
        self.prefetch, self.compute_dtype = prefetch, compute_dtype
        self.layers = select_layers(
            model,
            layers,
            budget_bytes=budget_bytes,
            activation_bytes=activation_bytes,
            prefetch=prefetch,
            compute_dtype=compute_dtype,
        )
        self._order = execution_order(model)
        cuda = self.device.type == "cuda"
        # Two side streams so host-to-device prefetches and device-to-host gradients use both copy engines.
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._d2h = torch.cuda.Stream(self.device) if cuda else None

        self._blocks: dict[int, _Block] = {}
        self._moved: list[tuple[nn.Parameter, torch.device]] = []
        self._moved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._place(cuda)
        self._stale = False  # an optimizer stepped since the compute-dtype copies were made
        self._handles = self._install()

        self._window = False  # between a forward's start and the end of its backward: p.data is the device tensor
        self._training = False
        self._backward = False
        self._finish_queued = False
        self._pos = 0
        self._schedule: list[int] = []
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # CPU gradients accumulated before this backward
        self._pending: list[tuple[nn.Parameter, torch.Tensor, torch.Event | None]] = []  # gradients on their way
        # Bytes copied so far, for benchmarks and tests: weights to the device, gradients to the host.
        self.copied_bytes = {"to_device": 0, "to_host": 0}

    # ----------------------------------------------------------------------------------------------- install/remove

    def _place(self, pin: bool) -> None:
        blocks = decoder_layers(self.model)
        offloaded = {id(p) for i in self.layers for p in blocks[i].parameters()}
        for i in self.layers:
            params = _unique(blocks[i].parameters())
            block = _Block(i, params, [], [], origins=[p.device for p in params])
            for p in params:
                master = p.detach().to("cpu")
                if pin:
                    master = master.pin_memory()
                work = torch.empty(p.shape, dtype=self.compute_dtype or p.dtype, device=self.device)
                _free(work)
                self._set_data(p, master)
                source = master if work.dtype == master.dtype else master.to(work.dtype)
                block.masters.append(master)
                block.works.append(work)
                block.sources.append(source.pin_memory() if pin and source is not master else source)
                block.versions.append(p._version)
            self._blocks[i] = block
        for p in _unique(self.model.parameters()):
            if id(p) not in offloaded and p.device != self.device:
                self._moved.append((p, p.device))
                self._set_data(p, p.data.to(self.device))
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.device:
                    self._moved_buffers.append((module, name, buffer))
                    module._buffers[name] = buffer.to(self.device)

    @staticmethod
    def _set_data(p: nn.Parameter, data: torch.Tensor) -> None:
        """Point `p` at `data`, carrying its gradient along (the `.grad` setter checks device and dtype)."""
        grad, p.grad = p.grad, None
        p.data = data
        if grad is not None:
            p.grad = grad.to(device=data.device, dtype=data.dtype)

    def _install(self) -> list:
        handles = [
            self.model.register_forward_pre_hook(self._begin),
            self.model.register_forward_hook(self._after_forward, always_call=True),
        ]
        for i, block in enumerate(decoder_layers(self.model)):
            handles.append(block.register_forward_pre_hook(partial(self._pre_forward, i)))
            handles.append(block.register_forward_hook(partial(self._post_forward, i)))
        for block in self._blocks.values():
            handles += [p.register_post_accumulate_grad_hook(self._grad_ready) for p in block.params]
        if any(source is not master for b in self._blocks.values() for source, master in zip(b.sources, b.masters)):
            handles.append(register_optimizer_step_post_hook(self._stepped))
        return handles

    def _stepped(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self._stale = True

    def remove(self) -> None:
        """Remove every hook and put every parameter and buffer back on the device it came from (same objects)."""
        self._end()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for block in self._blocks.values():
            for p, master, origin in zip(block.params, block.masters, block.origins):
                self._set_data(p, master.to(origin))
        for p, origin in self._moved:
            self._set_data(p, p.data.to(origin))
        for module, name, buffer in self._moved_buffers:
            module._buffers[name] = buffer
        self._blocks, self._moved, self._moved_buffers = {}, [], []

    @property
    def offloaded_parameters(self) -> list[nn.Parameter]:
        return [p for block in self._blocks.values() for p in block.params]

    def build_optimizer(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict] | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **kwargs,
    ) -> torch.optim.Optimizer:
        """A plain `optimizer_cls` over `params` (default: all of the model's) whose step runs on each parameter's
        device: resident parameters on the compute device, offloaded ones on the CPU.

        Each parameter group is split into its resident and its offloaded part (same options), resident parts first:
        torch optimizers step group by group, so the device kernels are all launched (asynchronously) before the CPU
        part starts, and the two overlap. The update is elementwise, so it equals one `optimizer_cls` over the
        unsplit groups. State stays addressable per parameter (`optimizer.state[p]`); note that `state_dict()` has
        the split groups. AdamW defaults to `fused=True` (torch's fused CPU AdamW is the fast CPU path).
        """
        groups = list(self.model.parameters() if params is None else params)
        if not groups:
            raise ValueError("offload: build_optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        offloaded = {id(p) for p in self.offloaded_parameters}
        resident, host = [], []
        for group in groups:
            group_params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            options = {key: value for key, value in group.items() if key != "params"}
            for part, keep in ((resident, False), (host, True)):
                if chosen := [p for p in group_params if (id(p) in offloaded) == keep]:
                    part.append({**options, "params": chosen})
        if issubclass(optimizer_cls, torch.optim.AdamW) and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused"] = True
        return optimizer_cls(resident + host, **kwargs)

    # ------------------------------------------------------------------------------------------- copies and memory

    def _fetch(self, block: _Block) -> None:
        """Allocate the block's device tensors and start copying the masters in (on the side stream when CUDA)."""
        if block.fetched:
            return
        block.fetched = True
        self.copied_bytes["to_device"] += sum(s.numel() * s.element_size() for s in block.sources)
        if self._h2d is None:
            for work, source in zip(block.works, block.sources):
                _alloc(work)
                work.copy_(source)
            return
        with torch.cuda.stream(self._h2d):
            for work, source in zip(block.works, block.sources):
                _alloc(work)  # allocated on the side stream; `_ready` records the compute stream's use
                work.copy_(source, non_blocking=True)  # same dtype, pinned: an asynchronous memcpy
            block.event = self._h2d.record_event()

    def _ready(self, block: _Block) -> None:
        """Make the compute stream wait for the block's copy before it uses the weights."""
        self._fetch(block)
        if block.ready:
            return
        block.ready = True
        if block.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(block.event)
            for work in block.works:
                work.record_stream(stream)  # the allocator reuses the memory only after the compute stream is done

    def _release(self, block: _Block) -> None:
        for work in block.works:
            _free(work)
        block.fetched = block.ready = False
        block.event = None

    def _advance(self, pos: int | None, current: int) -> None:
        """Block `current` is about to run at schedule position `pos`: keep/fetch the offloaded blocks of positions
        pos..pos+prefetch, release the others, and make `current` ready."""
        needed = [current] if current in self._blocks else []
        if pos is not None:
            needed += [i for i in self._schedule[pos : pos + self.prefetch + 1] if i in self._blocks]
        for block in self._blocks.values():
            if block.fetched and block.index not in needed:
                self._release(block)
        for index in dict.fromkeys(needed):
            self._fetch(self._blocks[index])
        if current in self._blocks:
            self._ready(self._blocks[current])

    # ------------------------------------------------------------------------------------------------------- hooks

    def _begin(self, module: nn.Module, args) -> None:
        self._end()  # a forward whose backward never ran (evaluation with grad enabled, an exception)
        self._window, self._backward, self._finish_queued, self._pos = True, False, False, 0
        self._training = torch.is_grad_enabled()
        self._schedule = self._order + self._order[::-1] if self._training else list(self._order)
        for block in self._blocks.values():
            for i, (p, master, work, source) in enumerate(zip(block.params, block.masters, block.works, block.sources)):
                if p.data_ptr() != master.data_ptr():
                    self._window = False
                    raise RuntimeError(
                        "offload: an offloaded parameter was moved or replaced while GranularOffload is applied "
                        "(model.to(), .half(), ...); call offload.remove() first and apply it again after"
                    )
                if source is not master and (self._stale or block.versions[i] != p._version):
                    source.copy_(master)
                    block.versions[i] = p._version
                if p.grad is not None:  # accumulated on the CPU; this backward's gradient is added at its end
                    self._grads[p] = p.grad
                    p.grad = None
                p.data = work
        self._stale = False
        for index in dict.fromkeys(self._schedule[: self.prefetch]):
            if index in self._blocks:
                self._fetch(self._blocks[index])

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if output is None or not self._training:  # an exception, or no backward will follow
            self._end()

    def _pre_forward(self, index: int, module: nn.Module, args) -> None:
        if not self._window:
            if index in self._blocks:
                raise RuntimeError("offload: an offloaded block was called outside the model's forward")
            return
        if torch._C._current_graph_task_id() != -1:  # recomputation in backward (checkpoint around the block)
            self._pre_backward(index, None, None)
            return
        self._pos += 1
        self._advance(self._pos - 1, index)

    def _post_forward(self, index: int, module: nn.Module, args, output) -> None:
        if not self._window or not self._training or torch._C._current_graph_task_id() != -1:
            return
        if (tensor := _grad_tensor(output)) is not None:
            # Fires when the gradient of this depth's output is complete, i.e. right before its backward.
            tensor.register_hook(partial(self._pre_backward, index, 2 * len(self._order) - self._pos))

    def _pre_backward(self, index: int, pos: int | None, grad: torch.Tensor | None) -> None:
        if not self._window:
            raise RuntimeError(
                "offload: a backward ran after its forward's window closed: run each training forward's backward "
                "before the next forward, and only once (retain_graph=True backward twice is not supported)"
            )
        self._queue_finish()  # from the outermost backward: a reentrant checkpoint's inner backward ends earlier
        self._backward = True
        self._advance(pos, index)

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Autograd has accumulated `p`'s gradient for this backward (once per backward, after its last use)."""
        self._queue_finish()
        grad, p.grad = p.grad, None
        self.copied_bytes["to_host"] += grad.numel() * grad.element_size()
        if self._d2h is None:
            self._pending.append((p, grad, None))
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
            host.copy_(grad, non_blocking=True)
            grad.record_stream(self._d2h)  # freed on the compute stream now, reused only after the copy
            self._pending.append((p, host, self._d2h.record_event()))

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            # Runs when the whole backward (the outermost graph task) is done.
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """Close the window: gradients into the CPU `.grad`, device copies released, `p.data` back to the masters."""
        if not self._window:
            return
        self._window = False
        if self._h2d is not None:
            self._h2d.synchronize()  # a prefetch still reading a master must finish before the optimizer writes it
        masters = {id(p): master for block in self._blocks.values() for p, master in zip(block.params, block.masters)}
        for p, grad, event in self._pending:
            if event is not None:
                event.synchronize()
            grad = grad.to(masters[id(p)].dtype)
            total = self._grads.get(p)
            self._grads[p] = grad if total is None else total.add_(grad)
        self._pending.clear()
        for block in self._blocks.values():
            self._release(block)
            for p, master in zip(block.params, block.masters):
                p.data = master
                if (grad := self._grads.pop(p, None)) is not None:
                    p.grad = grad
