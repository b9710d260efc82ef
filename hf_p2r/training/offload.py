"""Granular CPU offload for training (M6-10T's second technique): chosen decoder layers live in CPU memory.

`GranularOffload(model, layers)` is applied to a model from outside; the model code knows nothing about it. The
parameters of the chosen blocks (`model.model.layers[i]`), their gradients and their optimizer state live in CPU
memory (each block's parameters, the copies sent to the device and the buffers gradients land in share one pinned
allocation when the compute device is CUDA, so their copies are asynchronous; the optimizer state is never copied);
every other parameter stays on the compute device. While the model
runs, each offloaded block is copied to the compute device just before it is needed (on a side stream, `prefetch`
positions ahead in execution order, so the copy overlaps compute) and its device copy is released after use;
gradients go back to CPU on another side stream as soon as autograd has accumulated them, and a worker thread adds
each to the parameter's CPU gradient while the backward goes on (the backward waits for a copy only while more than
`max_inflight_bytes` of gradients are in flight, and at its end for the last ones). Each offloaded gradient's norm is
taken on the compute device as it leaves (of a sum over micro-batches, by the worker that sums it), so
`clip_grad_norm_` makes no pass over CPU gradients to measure them. The optimizer step of the offloaded parameters runs
on the CPU, after the device step of the resident ones has been launched (`optimizer_step="host"`; with `overlap_step`,
block by block on the worker thread while the next forward runs, each block's fetch waiting for its own step, as the
trainer runs it), or on the compute device a bounded chunk at a time, their optimizer state kept in pinned host memory
and copied in and out with each chunk (`optimizer_step="device_chunked"`, Megatron-Core's chunked optimizer-state
offload).

    offload = GranularOffload(model, layers=0.5, device="cuda")   # or [1, 3, 5, 7], or "auto" with a budget
    optimizer = offload.build_optimizer(lr=3e-4, weight_decay=0.1)
    for batch in batches:
        model(**batch).loss.backward()              # offloaded .grad are CPU tensors after backward
        offload.clip_grad_norm_(model.parameters(), 1.0)   # torch's clip_grad_norm_, offloaded norms already taken
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

Under autocast pass `compute_dtype` (the autocast dtype): otherwise autocast caches a low-precision cast of every
offloaded weight, and autograd saves it, from forward to backward, and offload frees no weight memory (a warning
says so).

Limits: one process (no DDP/FSDP/tensor parallelism: they raise `ValueError`); weights written through `p.data`
between steps are not seen by the `compute_dtype` copies (use `p.copy_` or an optimizer step, which are).
"""

import copy
import math
import types
import warnings
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..compat import in_backward, tensor_version
from ..distributed.materialize import materialize
from ..planning.memory import offload_working_set_bytes
from .config import TrainArguments

__all__ = [
    "GranularOffload",
    "apply_offload",
    "decoder_layers",
    "estimate_device_bytes",
    "estimate_host_bytes",
    "execution_order",
    "measure_activation_bytes",
    "measure_offload_activations",
    "offload_working_set_bytes",
    "select_layers",
    "spread_layers",
]

# Fraction of the device's memory that `layers="auto"` plans for when no budget is given: the estimate leaves out
# the allocator's fragmentation, CUDA context and the peak of one block's recomputation.
DEFAULT_BUDGET_FRACTION = 0.85

# Where the offloaded parameters' optimizer step runs (`GranularOffload(optimizer_step=...)`): "host", on the CPU over
# the CPU masters and CPU optimizer state (ZeRO-Offload's cut); "device_chunked", on the compute device, a chunk of
# parameters at a time: each chunk's masters, gradients and optimizer state are copied in, stepped, copied back
# (Megatron-Core's chunked optimizer-state offload; the state lives in pinned host memory).
OPTIMIZER_STEPS = ("host", "device_chunked")
# The bound on one chunk of "device_chunked": its parameters, their gradients and their optimizer state, in bytes.
DEFAULT_CHUNK_BYTES = 256 * 2**20

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
    AdamW). Offloaded blocks cost only their working set (`offload_working_set_bytes`, in `compute_dtype`).
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
        uses = Counter(execution_order(model))
        shared = sum(uses[i] > 1 for i in offloaded)
        total += offload_working_set_bytes(
            block_bytes, block_bytes, offloaded=len(offloaded), shared=shared, prefetch=prefetch
        )
    return total


def estimate_host_bytes(
    model: nn.Module,
    offloaded: Iterable[int],
    *,
    compute_dtype: torch.dtype | None = None,
    pinned: bool = True,
    optimizer_states: int = 2,
) -> int:
    """CPU bytes of the blocks `offloaded`: what `GranularOffload` allocates for them, plus their gradients and their
    optimizer state (`optimizer_states` tensors per parameter, AdamW: 2, in the parameter's dtype).

    Each block has one allocation (`_slab_specs`): its parameters, their `compute_dtype` copies to send (when that
    dtype differs) and the buffers their gradients land in. `pinned` (the compute device is CUDA): torch's caching
    host allocator rounds every pinned allocation up to a power of two, so that is what it costs.
    """
    blocks = decoder_layers(model)
    total = 0
    for i in sorted(set(offloaded)):
        params = _unique(blocks[i].parameters())
        slab = _slab_bytes(_slab_specs(params, compute_dtype))
        total += 1 << (slab - 1).bit_length() if pinned and slab > 1 else slab
        total += (1 + optimizer_states) * sum(p.numel() * p.element_size() for p in params)
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
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss  # as the trainer's forward
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
            raise ValueError(
                f"offload: block indices {bad} out of range: the model has blocks 0..{num_blocks - 1} (a pseudo "
                "model counts its shared blocks); give a ratio of its blocks (0.5) or 'auto' to offload what exists"
            )
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


# Offsets of the tensors in a block's host allocation: cache-line aligned (CPU AdamW kernels, DMA engines).
_ALIGN = 64


def _slab_specs(params: Sequence[torch.Tensor], compute_dtype: torch.dtype | None) -> list[tuple]:
    """(shape, dtype) of a block's host tensors, in order: the masters; the copies sent to the device, for the
    parameters whose dtype differs from `compute_dtype`; the buffers gradients land in (in the device dtype)."""
    works = [compute_dtype or p.dtype for p in params]
    return (
        [(p.shape, p.dtype) for p in params]
        + [(p.shape, dtype) for p, dtype in zip(params, works) if dtype != p.dtype]
        + [(p.shape, dtype) for p, dtype in zip(params, works)]
    )


def _slab_bytes(specs: list[tuple]) -> int:
    return sum(-(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN for shape, dtype in specs)


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


def _slab(specs: list[tuple], pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host allocation (pinned if `pin`) and a tensor per (shape, dtype) of `specs` laid out in it.

    Pinning it whole costs one power-of-two rounding per block instead of one per tensor. Each tensor gets a storage
    of its own (a slice of the allocation's storage, which keeps the allocation alive): `state_dict()` consumers that
    drop or clone tensors sharing a storage (safetensors, Accelerate's `save_state`) see distinct tensors.
    """
    slab = torch.empty(_slab_bytes(specs), dtype=torch.uint8, pin_memory=pin)
    storage, offset, tensors = slab.untyped_storage(), 0, []
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(torch.empty(0, dtype=dtype).set_(storage[offset : offset + nbytes]).view(shape))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return slab, tensors


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
        max_inflight_bytes: gradient bytes whose copy to the host may be in flight before the backward waits for the
            oldest (CUDA; default: the largest offloaded block's gradients).
        optimizer_step: where `build_optimizer`'s optimizer steps the offloaded parameters: "host" (the CPU) or
            "device_chunked" (the compute device, `chunk_bytes` of parameters, gradients and state at a time; see
            `step_in_chunks`). The pinned state of "device_chunked" is not in `estimate_host_bytes`.
        overlap_step: "host" only: `build_optimizer`'s step returns once the resident part is launched and steps each
            offloaded block on the worker thread, each block's next fetch waiting for its own step (`step_overlapped`;
            `synchronize` before reading offloaded weights or optimizer state other than through a forward or
            `state_dict`). `clip_grad_norm_` then leaves the offloaded gradients' scaling to that step. torch.optim
            classes only; another class steps its offloaded part at once, as without it.
        materialize: for a model on the meta device, `materialize(modules, device)` allocates and initialises the
            tensors of `modules` on `device` (`hf_p2r.distributed.materialize`, as `apply_offload` passes it): called
            once for the resident modules (on the compute device), then for each offloaded block (on the CPU) just
            before it is copied into its slab, so the host holds the offloaded blocks and one block at most.

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
        max_inflight_bytes: int | None = None,
        optimizer_step: str = "host",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        overlap_step: bool = False,
        materialize: Callable[[list[nn.Module], torch.device], object] | None = None,
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
        if max_inflight_bytes is not None and (not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0):
            raise ValueError(f"offload: max_inflight_bytes must be a non-negative integer, got {max_inflight_bytes!r}")
        if optimizer_step not in OPTIMIZER_STEPS:
            raise ValueError(
                f"offload: optimizer_step must be one of {', '.join(OPTIMIZER_STEPS)}, got {optimizer_step!r}"
            )
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"offload: chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.optimizer_step, self.chunk_bytes = optimizer_step, chunk_bytes
        self.overlap_step = overlap_step and optimizer_step == "host"
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
        self._place(cuda, materialize)
        self._stale = False  # an optimizer stepped since the compute-dtype copies were made
        self._handles = self._install()

        self._window = False  # between a forward's start and the end of its backward: p.data is the device tensor
        self._training = False
        self._backward = False
        self._finish_queued = False
        self._pos = 0
        self._schedule: list[int] = []
        self._bpos: int | None = None  # schedule position of the backward running now
        self._recomputed = False  # a recomputation at `_bpos` has run (see `_recompute_position`)
        self._freed: torch.Event | None = None  # CUDA: compute stream point after the last released block's use
        self._warned_autocast = False
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # CPU gradients accumulated before this backward
        # The gradient path: each gradient copied into its staging buffer on the side stream (CUDA), then added to its
        # CPU gradient by one worker thread while the backward goes on. `_pending`: the worker's task per parameter
        # (its staging buffer is busy until it is done); `_inflight`: copies not yet known to be done, with their bytes
        # (device gradients are kept alive until then: the backward waits only when they exceed `max_inflight_bytes`).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-p2r-offload")
        self._pending: dict[nn.Parameter, Future] = {}
        self._inflight: deque[tuple[torch.Event, int]] = deque()
        self._inflight_bytes = 0
        largest = max((sum(w.numel() * w.element_size() for w in b.works) for b in self._blocks.values()), default=0)
        self.max_inflight_bytes = largest if max_inflight_bytes is None else max_inflight_bytes
        # Gradient norms (see `clip_grad_norm_`): this backward's, per parameter, as the worker leaves them; then, for
        # the `.grad` they describe, (norm, that gradient, its version counter when measured).
        self._part_norms: dict[nn.Parameter, torch.Tensor] = {}
        self._norms: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # `overlap_step`: each offloaded block's optimizer step, on the worker, until its next fetch waits for it; the
        # ids of the optimizers stepping them (their steps leave `_stale` alone); a clip's scale left to those steps.
        self._steps: dict[int, Future] = {}
        self._views: set[int] = set()
        self._clip: tuple[torch.Tensor, dict] | None = None
        self._overlapping = False  # the last optimizer `build_optimizer` made steps blocks on the worker
        self._chunking = False  # ... or steps them on the device in chunks
        # Bytes copied so far, for benchmarks and tests: weights to the device, gradients to the host.
        self.copied_bytes = {"to_device": 0, "to_host": 0}

    # ----------------------------------------------------------------------------------------------- install/remove

    def _place(self, pin: bool, materialize=None) -> None:
        blocks = decoder_layers(self.model)
        if materialize is None:
            _check_materialized(self.model)
        if materialize is not None:  # a model on the meta device: the resident modules materialised on the device
            resident = _outside(self.model, [blocks[i] for i in self.layers])
            materialize(resident, self.device)
            # `remove` puts them on the CPU, where a model without offload lives, as it does a model placed from there.
            host = torch.device("cpu")
            self._moved += [(p, host) for p in _unique(p for module in resident for p in module.parameters())]
            self._moved_buffers += [
                (module, name, buffer.to(host))
                for root in resident
                for module in root.modules()
                for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False)
            ]
        for i in self.layers:
            if materialize is not None:  # each offloaded block on the CPU, then copied into its slab before the next
                materialize([blocks[i]], torch.device("cpu"))
            params = _unique(blocks[i].parameters())
            slab, tensors = _slab(_slab_specs(params, self.compute_dtype), pin)
            n = len(params)
            masters, converted, staging = tensors[:n], iter(tensors[n:-n]), tensors[-n:]
            block = _Block(i, params, slab, masters, [], staging=staging, origins=[p.device for p in params])
            for p, master in zip(params, masters):
                master.copy_(p.detach())
                work = torch.empty(p.shape, dtype=self.compute_dtype or p.dtype, device=self.device)
                _free(work)
                self._set_data(p, master)
                source = master if work.dtype == master.dtype else next(converted).copy_(master)
                block.works.append(work)
                block.sources.append(source)
                block.versions.append(tensor_version(p))
            self._blocks[i] = block
        # {parameter: (master, staging buffer)} for the gradient path; {parameter: (block, index)}.
        self._host = {p: (m, s) for b in self._blocks.values() for p, m, s in zip(b.params, b.masters, b.staging)}
        self._where = {p: (b, i) for b in self._blocks.values() for i, p in enumerate(b.params)}
        _check_materialized(self.model)
        offloaded = {id(p) for i in self.layers for p in blocks[i].parameters()}
        for p in _unique(self.model.parameters()):
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
        if self.overlap_step:  # what reads or writes every weight waits for the steps still running
            handles.append(self.model.register_state_dict_pre_hook(lambda *args: self.synchronize()))
            handles.append(self.model.register_load_state_dict_pre_hook(lambda *args: self.synchronize()))
        if any(source is not master for b in self._blocks.values() for source, master in zip(b.sources, b.masters)):
            handles.append(register_optimizer_step_post_hook(self._stepped))
        return handles

    def _stepped(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if id(optimizer) not in self._views:  # a block's step refreshes its own copies
            self._stale = True

    def synchronize(self) -> None:
        """Wait for the offloaded blocks' optimizer steps still running (`overlap_step`). A block's next fetch, the
        model's and the optimizer's `state_dict`/`load_state_dict`, the next step and `remove` wait by themselves; call
        it before reading offloaded weights or optimizer state otherwise."""
        while self._steps:
            _, task = self._steps.popitem()
            task.result()

    def remove(self) -> None:
        """Remove every hook and put every parameter and buffer back on the device it came from (same objects)."""
        self.synchronize()
        self._end()
        self._worker.shutdown()
        for handle in self._handles:
            handle.remove()
        self._handles, self._host, self._norms, self._where = [], {}, {}, {}
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
        device: resident parameters on the compute device, offloaded ones on the CPU (`optimizer_step="host"`) or, with
        `optimizer_step="device_chunked"`, on the compute device a chunk at a time (`step_in_chunks`).

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
        optimizer = optimizer_cls(resident + host, **kwargs)
        # `overlap_step` steps blocks through shallow copies of the optimizer: for torch's own classes, whose step
        # reads only `param_groups` and `state`; another class (one with inner optimizers) steps its offloaded part
        # at once, on the CPU, as without `overlap_step`.
        self._overlapping = self.overlap_step and optimizer_cls.__module__.startswith("torch.optim.")
        if self._overlapping:
            step = optimizer.step

            def step_overlapped(optimizer: torch.optim.Optimizer, closure=None):
                return self.step_overlapped(optimizer, step, closure)

            optimizer.step = types.MethodType(step_overlapped, optimizer)
            optimizer.register_state_dict_pre_hook(lambda *args: self.synchronize())
            optimizer.register_load_state_dict_pre_hook(lambda *args: self.synchronize())
        self._chunking = self.optimizer_step == "device_chunked"
        if self._chunking:
            step = optimizer.step  # the class's step (with torch's step hooks), bound to this optimizer

            def step_in_chunks(optimizer: torch.optim.Optimizer, closure=None):
                return self.step_in_chunks(optimizer, step, closure)

            optimizer.step = types.MethodType(step_in_chunks, optimizer)  # a method still: LR schedulers wrap it
        return optimizer

    def _offloaded_gradients(self, optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
        """The offloaded parameters `optimizer` steps that have a gradient, each with its group, and their gradients."""
        offloaded = [
            (p, group)
            for group in optimizer.param_groups
            for p in group["params"]
            if p in self._host and p.grad is not None
        ]
        return offloaded, {p: p.grad for p, _ in offloaded}

    def step_overlapped(self, optimizer: torch.optim.Optimizer, step, closure=None):
        """`overlap_step`: `step` (the optimizer's own) over the resident parameters now, then each offloaded block's
        part on the worker thread, blocks in the order the next forward needs them; returns without waiting for them.
        Each block's next fetch waits for its step, so the CPU updates overlap the device's work that does not need
        them (the rest of the step, the next forward up to that block).

        A block is stepped by a shallow copy of the optimizer (`copy.copy`: its own empty hooks, no patched `step`)
        whose groups hold the block's CPU masters (with the group's current options) and whose state maps each master
        to its parameter's state dict, filled in place: the same update as one call for any optimizer whose update of
        a parameter reads only that parameter, its gradient, its state and its group (every torch optimizer). The
        offloaded gradients are handed to these steps: after `step` the offloaded parameters' `.grad` is None. A clip
        by `clip_grad_norm_` just before scales them there too (once its device-side factor is known, on the worker).
        """
        self.synchronize()
        offloaded, grads = self._offloaded_gradients(optimizer)
        for p in grads:
            p.grad = None
        stale = self._stale
        try:
            loss = step(closure)  # the resident parameters, on the compute device
        except BaseException:
            for p, grad in grads.items():
                p.grad = grad
            raise
        self._stale = stale
        coef, clipped = self._clip if self._clip is not None else (None, {})
        self._clip = None
        if coef is not None and self._h2d is not None:  # CUDA: the worker reads it once the compute stream made it
            coef = (coef, torch.cuda.current_stream(self.device).record_event())
        parts: dict[int, dict[int, tuple[dict, list]]] = {}  # block index -> {id(group): (group, [(p, master)])}
        for p, group in offloaded:
            block, i = self._where[p]
            block.masters[i].grad = grads[p]
            parts.setdefault(block.index, {}).setdefault(id(group), (group, []))[1].append((p, block.masters[i]))
        for index in dict.fromkeys(self._order):
            if index not in parts:
                continue
            view = copy.copy(optimizer)
            view.param_groups = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": [m for _, m in pairs]}
                for group, pairs in parts[index].values()
            ]
            pairs = [pair for _, pairs in parts[index].values() for pair in pairs]
            view.state = defaultdict(dict, {master: optimizer.state[p] for p, master in pairs})
            scaled = [master.grad for p, master in pairs if clipped.get(p) == (id(grads[p]), tensor_version(grads[p]))]
            self._views.add(id(view))
            self._steps[index] = self._worker.submit(self._step_block, self._blocks[index], view, scaled, coef)
        return loss

    def _step_block(self, block: _Block, view: torch.optim.Optimizer, scaled: list, coef) -> None:
        """The worker: a block's deferred clip and its optimizer step on the CPU, then its copies to send. `coef`: the
        clip's factor, with (CUDA) the event after which the compute stream has it."""
        try:
            if scaled:
                if isinstance(coef, tuple):
                    coef, made = coef
                    made.synchronize()  # waits for the norm on the device, here rather than in the step
                factor = coef.to("cpu")
                for grad in scaled:
                    grad.mul_(factor)  # as clip_grads_with_norm_ scales them
            type(view).step(view)
        finally:
            for group in view.param_groups:
                for master in group["params"]:
                    master.grad = None
            self._views.discard(id(view))
        for i, (p, master, source) in enumerate(zip(block.params, block.masters, block.sources)):
            if source is not master:
                source.copy_(master)
            block.versions[i] = tensor_version(p)

    def step_in_chunks(self, optimizer: torch.optim.Optimizer, step, closure=None):
        """`optimizer_step="device_chunked"`: `step` (the optimizer's own) first over the resident parameters, then
        once per chunk of offloaded parameters with a gradient, each with its master, gradient and optimizer state
        copied to the compute device and back after. A chunk holds parameters in optimizer order up to `chunk_bytes`
        of parameters, gradients and state (a larger parameter is a chunk alone).

        Each call sees gradients on only the parameters it steps (the others' `.grad` are set aside, and every torch
        optimizer skips a parameter without one), so any optimizer class whose update of a parameter reads only that
        parameter, its gradient, its state and its group steps as it would in one call. The state returns to host
        memory (pinned on CUDA, one allocation per chunk), in the dtype and shape the optimizer made it; a `step`
        count stays where torch's `load_state_dict` keeps it (on the CPU unless the group is fused or capturable).
        With `compute_dtype`, the copies the next forward sends are cast on the device and copied back too. A clip by
        `clip_grad_norm_` just before scales the offloaded gradients here, on the device (then they are consumed: their
        `.grad` is None after the step; otherwise it is kept as after any step). Returns
        when the host has every result (CUDA: the compute stream is synchronised once, after the last chunk).
        """
        offloaded, grads = self._offloaded_gradients(optimizer)
        coef, clipped = self._clip if self._clip is not None else (None, {})
        self._clip = None  # a clip just before: its factor scales the offloaded gradients on the device, per chunk
        scaled = {p for p, grad in grads.items() if clipped.get(p) == (id(grad), tensor_version(grad))}
        stale = self._stale  # an optimizer stepped offloaded masters before this step (see `_stepped`)
        for p in grads:
            p.grad = None
        try:
            loss = step(closure)  # the resident parameters, on the compute device
            for group in optimizer.param_groups:  # each call after it steps one chunk of offloaded parameters
                for p in group["params"]:
                    if p.grad is not None:
                        grads[p], p.grad = p.grad, None
            chunk, size = [], 0
            for p, group in offloaded:
                tensors = sum(
                    isinstance(v, torch.Tensor) and v.numel() == p.numel() for v in optimizer.state.get(p, {}).values()
                )
                nbytes = p.numel() * p.element_size() * (2 + (tensors or 2))  # parameter, gradient, state (AdamW: 2)
                if chunk and size + nbytes > self.chunk_bytes:
                    self._step_chunk(optimizer, step, chunk, grads, scaled, coef)
                    chunk, size = [], 0
                chunk.append((p, group))
                size += nbytes
            if chunk:
                self._step_chunk(optimizer, step, chunk, grads, scaled, coef)
        finally:
            for p, grad in grads.items():
                p.grad = None if p in scaled else grad  # a clipped offloaded gradient was consumed unscaled
        if self._h2d is not None:
            torch.cuda.current_stream(self.device).synchronize()
        self._stale = stale  # every offloaded master stepped here has fresh copies to send
        return loss

    def _step_chunk(self, optimizer: torch.optim.Optimizer, step, chunk: list, grads: dict, scaled: set, coef) -> None:
        state, device, pin = optimizer.state, self.device, self._h2d is not None

        def stays(key: str, group: dict) -> bool:  # torch's `load_state_dict` policy for a step count
            return key == "step" and not (group.get("fused") or group.get("capturable"))

        moved = []
        try:
            for p, group in chunk:
                master, host_state = p.data, state.get(p, {})
                moved.append((p, group, master, host_state))
                p.data = master.to(device, copy=True, non_blocking=True)
                p.grad = grads[p].to(device, copy=True, non_blocking=True)
                if p in scaled:
                    p.grad.mul_(coef.to(device))  # as clip_grads_with_norm_ scales it
                if host_state:
                    state[p] = {
                        k: v.to(device, copy=True, non_blocking=True)
                        if isinstance(v, torch.Tensor) and not stays(k, group)
                        else v
                        for k, v in host_state.items()
                    }
            step()  # only this chunk's parameters have gradients
        finally:
            fresh = []  # (state dict, key, device tensor) needing new host memory
            for p, group, master, host_state in moved:
                master.copy_(p.data, non_blocking=True)
                block, i = self._where[p]
                if (source := block.sources[i]) is not master:  # the copy the next forward sends, cast here
                    source.copy_(p.data.to(source.dtype), non_blocking=True)
                returned = {}
                for k, v in state.get(p, {}).items():
                    if not isinstance(v, torch.Tensor) or stays(k, group) or v.device != device:
                        returned[k] = v
                    elif (
                        (old := host_state.get(k)) is not None
                        and (old.shape, old.dtype) == (v.shape, v.dtype)
                        and (old.is_pinned() or not pin)
                    ):
                        returned[k] = old.copy_(v, non_blocking=True)
                    else:
                        fresh.append((returned, k, v))
                if p in state:
                    state[p] = returned
                p.grad = None
                p.data = master
                block.versions[i] = tensor_version(p)
            if fresh:
                _, tensors = _slab([(v.shape, v.dtype) for _, _, v in fresh], pin)
                for (returned, k, v), host in zip(fresh, tensors):
                    returned[k] = host.copy_(v, non_blocking=True)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` (2-norm) over `parameters`, without a pass over offloaded gradients to
        measure them: each offloaded gradient's norm was taken as it left the device (or, for a sum of several
        backwards' parts, by the worker that summed it, during the backward). A gradient changed since (its version
        counter moved: unscaled, clipped, zeroed) is measured again. The total is the 2-norm of the per-tensor norms in
        parameter order, as torch computes it, and the gradients are scaled by `clip_grads_with_norm_`, the offloaded
        ones by the next step of the optimizer `build_optimizer` made where it steps them on the worker or the device
        (`overlap_step`, "device_chunked"); on one device (the CPU) the result is torch's bit for bit. Returns the total
        norm, on the compute device.
        """
        params = [p for p in parameters if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        norms = []
        for p in params:
            norm, grad, version = self._norms.get(p, (None, None, None))
            if grad is not p.grad or version != tensor_version(p.grad):
                norm = torch.linalg.vector_norm(p.grad)
            norms.append(norm.to(self.device, non_blocking=True))
        total = torch.linalg.vector_norm(torch.stack(norms))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"offload: the total norm of the gradients is {total.item()}")
        if not (self._overlapping or self._chunking):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            return total
        # Offloaded gradients are scaled by the next step of the optimizer `build_optimizer` made, off the critical
        # path (`step_overlapped`: on the worker; `step_in_chunks`: on the device): the same factor as
        # `clip_grads_with_norm_`'s, for the gradients as they are now (a gradient changed before the step is left as
        # it is then); that step consumes them (their `.grad` is None after it).
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p not in self._host], max_norm, total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clip = coef, {p: (id(p.grad), tensor_version(p.grad)) for p in params if p in self._host}
        return total

    # ------------------------------------------------------------------------------------------- copies and memory

    def _fetch(self, block: _Block) -> None:
        """Allocate the block's device tensors and start copying the masters in (on the side stream when CUDA)."""
        if block.fetched:
            return
        if (step := self._steps.pop(block.index, None)) is not None:  # `overlap_step`: its update is done first
            step.result()
        block.fetched = True
        self.copied_bytes["to_device"] += sum(s.numel() * s.element_size() for s in block.sources)
        if self._h2d is None:
            for work, source in zip(block.works, block.sources):
                _alloc(work)
                work.copy_(source)
            return
        with torch.cuda.stream(self._h2d):
            # Device memory stays bounded by `prefetch + 1` blocks however far the CPU runs ahead of the GPU. The copies
            # are allocated on this side stream and `_release` frees them without `record_stream`, so the caching
            # allocator hands a released block's memory straight to the next allocation on this stream. That is safe
            # because this stream first waits for the compute stream's last use of every released block (the event
            # `_release` recorded): a copy into reused memory starts only after the kernels reading it are done.
            # (With `record_stream` the allocator reuses memory only once the GPU has passed the recorded point, as
            # seen from the CPU at allocation time; a CPU running ahead then gets fresh memory for every fetch and the
            # cache grows until an out-of-memory retry stalls it. FSDP2 orders its all-gather buffers the same way.)
            if self._freed is not None:
                self._h2d.wait_event(self._freed)
            for work, source in zip(block.works, block.sources):
                _alloc(work)
                work.copy_(source, non_blocking=True)  # same dtype, pinned: an asynchronous memcpy
            block.event = self._h2d.record_event()

    def _ready(self, block: _Block) -> None:
        """Make the compute stream wait for the block's copy before it uses the weights."""
        self._fetch(block)
        if block.ready:
            return
        block.ready = True
        if block.event is not None:
            torch.cuda.current_stream(self.device).wait_event(block.event)

    def _release(self, block: _Block) -> None:
        for work in block.works:
            _free(work)
        block.fetched = block.ready = False
        block.event = None
        if self._h2d is not None:  # the next fetch waits for this point of the compute stream (see `_fetch`)
            self._freed = torch.cuda.current_stream(self.device).record_event()

    def _bound_inflight(self, event: torch.Event, nbytes: int) -> None:
        """CUDA: count a gradient copy in flight; wait (on the CPU) for the oldest ones only while more than
        `max_inflight_bytes` are. Gradients are freed with `record_stream` (autograd allocates them on the compute
        stream), so their memory is reused only after their copy: without a bound a CPU running ahead of the GPU would
        keep every block's gradients allocated. Below it the backward never waits for a copy."""
        self._inflight.append((event, nbytes))
        self._inflight_bytes += nbytes
        while self._inflight and (self._inflight_bytes > self.max_inflight_bytes or self._inflight[0][0].query()):
            done, size = self._inflight.popleft()
            done.synchronize()
            self._inflight_bytes -= size

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
        self._bpos, self._recomputed = None, False
        self._training = torch.is_grad_enabled()
        self._schedule = self._order + self._order[::-1] if self._training else list(self._order)
        self._check_autocast()
        for block in self._blocks.values():
            for i, (p, master, work, source) in enumerate(zip(block.params, block.masters, block.works, block.sources)):
                if p.data_ptr() != master.data_ptr():
                    self._window = False
                    raise RuntimeError(
                        "offload: an offloaded parameter was moved or replaced while GranularOffload is applied "
                        "(model.to(), .half(), ...); call offload.remove() first and apply it again after"
                    )
                stepping = block.index in self._steps  # its step refreshes its copies (`_step_block`)
                if source is not master and not stepping and (self._stale or block.versions[i] != tensor_version(p)):
                    source.copy_(master)
                    block.versions[i] = tensor_version(p)
                if p.grad is not None:  # accumulated on the CPU; this backward's gradient is added to it
                    self._grads[p] = p.grad
                    p.grad = None
                self._norms.pop(p, None)
                p.data = work
        self._stale = False
        for index in dict.fromkeys(self._schedule[: self.prefetch]):
            if index in self._blocks:
                self._fetch(self._blocks[index])

    def _check_autocast(self) -> None:
        """Warn once when autocast would cast offloaded weights: it caches each cast (and autograd saves it) until
        the autocast region ends, so the weights' memory would not be freed between their uses."""
        device_type = self.device.type
        if self._warned_autocast or not self._blocks or not torch.is_autocast_enabled(device_type):
            return
        dtype = torch.get_autocast_dtype(device_type)
        if any(work.dtype != dtype for block in self._blocks.values() for work in block.works):
            self._warned_autocast = True
            runs_in = self.compute_dtype or "their parameters' dtype"
            warnings.warn(
                f"offload: {device_type} autocast to {dtype} is on, but the offloaded blocks run in {runs_in}: "
                f"autocast keeps a {dtype} copy of every offloaded weight from forward to backward, so offload frees "
                f"no weight memory; pass compute_dtype={dtype}",
                stacklevel=2,
            )

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if output is None or not self._training:  # an exception, or no backward will follow
            self._end()

    def _pre_forward(self, index: int, module: nn.Module, args) -> None:
        if not self._window:
            if index in self._blocks:
                raise RuntimeError("offload: an offloaded block was called outside the model's forward")
            return
        if in_backward():  # recomputation in backward (checkpoint around the block)
            self._enter_backward(index, self._recompute_position(index))
            self._recomputed = True
            return
        self._pos += 1
        self._advance(self._pos - 1, index)

    def _recompute_position(self, index: int) -> int | None:
        """Backward position of a recomputation of block `index` that runs the block's hooks (a checkpoint applied
        around the block after offload). Non-reentrant: the block's output gradient hook has just announced the
        position (`_pre_backward`), and this is its recomputation. Reentrant: the forward ran without grad and left no
        hook, and depths are recomputed in backward order, so it is the next position. None if the schedule says
        otherwise (then only this block is fetched)."""
        pos = self._bpos if self._bpos is not None else len(self._order) - 1
        if self._bpos is None or self._recomputed:
            pos += 1
        return pos if pos < len(self._schedule) and self._schedule[pos] == index else None

    def _post_forward(self, index: int, module: nn.Module, args, output) -> None:
        if not self._window or not self._training or in_backward():
            return
        if (tensor := _grad_tensor(output)) is not None:
            # Fires when the gradient of this depth's output is complete, i.e. right before its backward.
            tensor.register_hook(partial(self._pre_backward, index, 2 * len(self._order) - self._pos))

    def _pre_backward(self, index: int, pos: int, grad: torch.Tensor) -> None:
        self._enter_backward(index, pos)
        self._recomputed = False

    def _enter_backward(self, index: int, pos: int | None) -> None:
        if not self._window:
            raise RuntimeError(
                "offload: a backward ran after its forward's window closed: run each training forward's backward "
                "before the next forward, and only once (retain_graph=True backward twice is not supported)"
            )
        self._queue_finish()  # from the outermost backward: a reentrant checkpoint's inner backward ends earlier
        self._backward = True
        if pos is not None and pos != self._bpos:
            self._bpos = pos
        self._advance(pos, index)

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Autograd has accumulated `p`'s gradient: once per backward after its last use, or with reentrant
        checkpointing once per inner backward that uses it. Its norm is taken where it is (the compute device) when it
        is the first part of `p`'s gradient; it is copied to `p`'s staging buffer (CUDA: on the side stream) and the
        worker adds it to `p`'s CPU gradient, while the backward goes on."""
        self._queue_finish()
        grad, p.grad = p.grad, None
        if (earlier := self._pending.pop(p, None)) is not None:  # the staging buffer still holds an earlier part
            earlier.result()
        master, host = self._host[p]
        nbytes = grad.numel() * grad.element_size()
        self.copied_bytes["to_host"] += nbytes
        # The norm of what `.grad` will hold (in the master's dtype); of a sum of parts the worker takes it instead.
        norm = None if p in self._grads else torch.linalg.vector_norm(grad, dtype=master.dtype)
        event = None
        if self._d2h is None:
            host.copy_(grad)
        else:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                host.copy_(grad, non_blocking=True)
                grad.record_stream(self._d2h)  # freed on the compute stream now, reused only after the copy
                event = self._d2h.record_event()
            self._bound_inflight(event, nbytes)
        self._pending[p] = self._worker.submit(self._collect, p, event, norm)

    def _collect(self, p: nn.Parameter, event: torch.Event | None, norm: torch.Tensor | None) -> None:
        """The worker: once the copy into `p`'s staging buffer is done, add it to `p`'s CPU gradient in one pass: the
        first is copied out in the master's dtype, later ones are added with type promotion (the same float32 sums as
        adding a converted copy, bit for bit). `norm` is the first part's; a sum's norm is taken here, on the CPU but
        off the critical path (overlapping the rest of the backward)."""
        if event is not None:
            event.synchronize()
        (master, host), total = self._host[p], self._grads.get(p)
        if total is None:
            self._grads[p] = host.to(master.dtype, copy=True)
            self._part_norms[p] = norm
        else:
            self._part_norms[p] = torch.linalg.vector_norm(total.add_(host))

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
        pending, self._pending = self._pending, {}
        for task in pending.values():
            task.result()
        self._inflight.clear()
        self._inflight_bytes = 0
        for block in self._blocks.values():
            self._release(block)
            for p, master in zip(block.params, block.masters):
                p.data = master
                if (grad := self._grads.pop(p, None)) is not None:
                    p.grad = grad
                    if (norm := self._part_norms.pop(p, None)) is not None:
                        self._norms[p] = (norm, grad, tensor_version(grad))


def apply_offload(model: nn.Module, args: TrainArguments, accelerator, activation_bytes: int = 0):
    """Granular CPU offload of `args.offload` blocks of `model` onto `accelerator.device`, or None without it.

    Apply it to the final structure (at the start, and again after each delink: `auto` re-selects the blocks).
    Raises `ConfigError` for `offload: auto` without `offload_budget_gb` on a device other than CUDA.
    """
    if args.offload is None:
        return None
    args.check_offload_budget(accelerator.device.type)  # ConfigError: `auto` with no device memory to plan for
    budget = None if args.offload_budget_gb is None else int(args.offload_budget_gb * 2**30)
    meta = any(param.is_meta for param in model.parameters())
    return GranularOffload(
        model,
        args.offload_spec,
        device=accelerator.device,
        prefetch=args.offload_prefetch,
        # The autocast dtype: otherwise autocast caches a cast of every offloaded weight until backward.
        compute_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision),
        budget_bytes=budget,
        activation_bytes=activation_bytes,
        optimizer_step=args.offload_optimizer,
        chunk_bytes=max(1, int(args.offload_chunk_mb * 2**20)),
        overlap_step=True,  # the engine calls `synchronize` before it reads weights or optimizer state itself
        # A model on the meta device: each part materialised straight into its home (`materialize`'s values).
        materialize=partial(_materialize_parts, model, args.seed) if meta else None,
    )


def _materialize_parts(model: nn.Module, seed: int, modules: list[nn.Module], device: torch.device) -> None:
    materialize(model, seed, keep=modules, device=device)


def measure_offload_activations(model: nn.Module, args: TrainArguments, block_size: int, accelerator) -> int:
    """Activation bytes of one training micro-batch, for `offload: auto` (0 for other offload modes).

    Measured on the CPU, before the model is placed (the pseudo model's activations equal the real model's), with
    one sequence of at most 512 tokens under the run's bf16 autocast, then scaled linearly to the micro-batch:
    attention is `sdpa`-like (linear in the sequence), so this is an estimate, like the rest of `auto`'s plan.
    """
    if args.offload != "auto":
        return 0
    tokens = min(block_size, 512)
    input_ids = torch.zeros((1, tokens), dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=accelerator.mixed_precision == "bf16"):
        measured = measure_activation_bytes(model, input_ids)
    return measured * args.per_device_batch_size * block_size // tokens
