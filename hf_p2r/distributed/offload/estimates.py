"""Which blocks granular offload moves to CPU memory, and what that costs: the selection (`select_layers`: indices,
a ratio, or `auto` within a device budget), the device and host bytes of a choice (`estimate_device_bytes`,
`estimate_host_bytes`, `offload_working_set_bytes`, which the planner uses too) and the layout of a block's one host
allocation (`slab_specs`, `slab_bytes`). Counting only: nothing here moves a tensor."""

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import partial

import torch
from torch import nn

from .step_time import spread_layers

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "GRADIENT_ACCUMULATIONS",
    "LayerSpec",
    "decoder_layers",
    "estimate_device_bytes",
    "estimate_host_bytes",
    "execution_order",
    "measure_activation_bytes",
    "offload_working_set_bytes",
    "select_layers",
    "slab_bytes",
    "slab_specs",
    "spread_layers",
    "unique",
]

# Fraction of the device's memory that `layers="auto"` plans for when no budget is given: the estimate leaves out
# the allocator's fragmentation, CUDA context and the peak of one block's recomputation.
DEFAULT_BUDGET_FRACTION = 0.85

# Where an offloaded block's gradients are summed over the micro-batches of a step (`GranularOffload(
# grad_accumulation=...)`): "host", each micro-batch's gradient sent to the CPU and added there (no device memory);
# "device", summed on the device in a buffer per offloaded parameter and sent once per optimizer step.
GRADIENT_ACCUMULATIONS = ("host", "device")

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


def unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """`params` without repeats (a tied or shared parameter once), in first-seen order."""
    return list({id(p): p for p in params}.values())


def _state_bytes(params: Sequence[torch.Tensor], optimizer_states: int) -> int:
    """Device bytes of resident parameters in training: the parameter, and for a trainable one its gradient and the
    optimizer's state tensors (AdamW: 2), all in the parameter's dtype."""
    return sum(p.numel() * p.element_size() * (1 + (1 + optimizer_states) * p.requires_grad) for p in params)


def offload_working_set_bytes(
    weight_bytes: int,
    grad_bytes: int,
    *,
    offloaded: int,
    shared: int = 0,
    prefetch: int = 1,
    accumulation_bytes: int = 0,
) -> int:
    """Device bytes the `offloaded` blocks of a `GranularOffload` need at once, for blocks of at most `weight_bytes`
    of device weights and `grad_bytes` of gradients (`estimate_device_bytes` and the planner use it).

    Weights: the block running and the `prefetch` blocks copied ahead of it; a released block's memory is reused by
    the next copy (see `GranularOffload._fetch`). Gradients: a block's stay on the device until their copy to the host
    is done, and the backward waits for the oldest copies once more than `max_inflight_bytes` are in flight (default:
    one block's gradients), so two blocks at most; but autograd sums the gradient of a block run at several depths
    (`shared`) in a buffer that lives from its last depth's backward to its first, so each shared block holds one
    more. `accumulation_bytes`: with `grad_accumulation="device"`, the buffers every offloaded parameter's gradient is
    summed in over a step's micro-batches (all offloaded blocks' parameters, in the accumulation dtype).
    """
    if offloaded <= 0:
        return 0
    return min(prefetch + 1, offloaded) * weight_bytes + min(offloaded, shared + 2) * grad_bytes + accumulation_bytes


def estimate_device_bytes(
    model: nn.Module,
    offloaded: Iterable[int],
    *,
    activation_bytes: int = 0,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
    optimizer_states: int = 2,
    accumulation_dtype: torch.dtype | None = None,
) -> int:
    """Device bytes of training `model` with the blocks `offloaded` in CPU memory.

    Resident parameters cost parameter + gradient + `optimizer_states` tensors each (16 bytes per fp32 parameter with
    AdamW). Offloaded blocks cost only their working set (`offload_working_set_bytes`, in `compute_dtype`), plus,
    with `accumulation_dtype` (`grad_accumulation="device"`), a gradient buffer per offloaded parameter in that dtype.
    `activation_bytes` (see `measure_activation_bytes`) is added as given; it does not depend on offload.
    """
    blocks = [unique(layer.parameters()) for layer in decoder_layers(model)]
    offloaded = sorted(set(offloaded))
    in_blocks = {id(p) for params in blocks for p in params}
    others = [p for p in unique(model.parameters()) if id(p) not in in_blocks]
    total = _state_bytes(others, optimizer_states) + activation_bytes
    total += sum(_state_bytes(params, optimizer_states) for i, params in enumerate(blocks) if i not in offloaded)
    if offloaded:
        block_bytes = max(sum(p.numel() * (compute_dtype or p.dtype).itemsize for p in blocks[i]) for i in offloaded)
        uses = Counter(execution_order(model))
        shared = sum(uses[i] > 1 for i in offloaded)
        accumulation = 0
        if accumulation_dtype is not None:
            accumulation = sum(p.numel() for i in offloaded for p in blocks[i]) * accumulation_dtype.itemsize
        total += offload_working_set_bytes(
            block_bytes,
            block_bytes,
            offloaded=len(offloaded),
            shared=shared,
            prefetch=prefetch,
            accumulation_bytes=accumulation,
        )
    return total


# Offsets of the tensors in a block's host allocation: cache-line aligned (CPU AdamW kernels, DMA engines).
ALIGN = 64


def slab_specs(
    params: Sequence[torch.Tensor],
    compute_dtype: torch.dtype | None,
    grad_dtype: torch.dtype | None = None,
    *,
    delayed: bool = False,
) -> list[tuple]:
    """(shape, dtype) of a block's host tensors, in order: the masters; the copies sent to the device, for the
    parameters whose dtype differs from `compute_dtype` (`delayed`: for every parameter, twice: the copies a step
    sends and those the update running meanwhile writes); the buffers gradients land in (in `grad_dtype`, default
    the device dtype)."""
    works = [compute_dtype or p.dtype for p in params]
    sources = [(p.shape, dtype) for p, dtype in zip(params, works) if dtype != p.dtype or delayed]
    return (
        [(p.shape, p.dtype) for p in params]
        + sources * (2 if delayed else 1)
        + [(p.shape, grad_dtype or dtype) for p, dtype in zip(params, works)]
    )


def slab_bytes(specs: list[tuple]) -> int:
    """Bytes of one host allocation laid out by `specs` (each tensor at an `ALIGN`-byte offset)."""
    return sum(-(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN for shape, dtype in specs)


def estimate_host_bytes(
    model: nn.Module,
    offloaded: Iterable[int],
    *,
    compute_dtype: torch.dtype | None = None,
    pinned: bool = True,
    optimizer_states: int = 2,
    grad_dtype: torch.dtype | None = None,
    delayed: bool = False,
    error_feedback: bool = False,
) -> int:
    """CPU bytes of the blocks `offloaded`: what `GranularOffload` allocates for them, plus their gradients and their
    optimizer state (`optimizer_states` tensors per parameter, AdamW: 2, in the parameter's dtype).

    Each block has one allocation (`slab_specs`): its parameters, their `compute_dtype` copies to send (when that
    dtype differs; `delayed`: two copies of each), and the buffers their gradients land in (in `grad_dtype`). With
    `grad_dtype` the parameter's (`grad_accumulation="device"`), that buffer is the gradient: none besides it.
    `error_feedback`: the last update of each parameter and the weights before the update running. `pinned` (the
    compute device is CUDA): torch's caching host allocator rounds every pinned allocation up to a power of two, so
    that is what it costs.
    """
    blocks = decoder_layers(model)
    total = 0
    for i in sorted(set(offloaded)):
        params = unique(blocks[i].parameters())
        slab = slab_bytes(slab_specs(params, compute_dtype, grad_dtype, delayed=delayed))
        total += 1 << (slab - 1).bit_length() if pinned and slab > 1 else slab
        extra = optimizer_states + 2 * error_feedback + (grad_dtype is None or grad_dtype != params[0].dtype)
        total += extra * sum(p.numel() * p.element_size() for p in params)
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
    accumulation_dtype: torch.dtype | None = None,
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
            accumulation_dtype=accumulation_dtype,
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
