"""The trainer's adapter to granular CPU offload (`hf_p2r.distributed.offload`): `apply_offload` builds a
`GranularOffload` from the run's fields (`offload`, `offload_budget_gb`, `offload_prefetch`, `offload_optimizer`, ...)
on the accelerator's device, and `measure_offload_activations` sizes `offload: auto`'s plan. The offload itself, its
selection, placement, hooks, gradient path and optimizer step, live in `hf_p2r.distributed.offload`; its public names
are re-exported here for the trainer's callers.
"""

from functools import partial

import torch
from torch import nn

from ..config import OffloadArguments
from ..distributed.materialize import materialize
from ..distributed.offload.estimates import (
    DEFAULT_BUDGET_FRACTION,
    decoder_layers,
    estimate_device_bytes,
    estimate_host_bytes,
    execution_order,
    measure_activation_bytes,
    offload_working_set_bytes,
    select_layers,
    spread_layers,
)
from ..distributed.offload.granular import GranularOffload
from ..distributed.offload.step import DEFAULT_CHUNK_BYTES, OPTIMIZER_STEPS

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "DEFAULT_CHUNK_BYTES",
    "OPTIMIZER_STEPS",
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


def apply_offload(
    model: nn.Module, args: OffloadArguments, accelerator, activation_bytes: int = 0, seed: int | None = None
):
    """Granular CPU offload of `args.offload` blocks of `model` onto `accelerator.device`, or None without it (`args`:
    the run's offload section).

    Apply it to the final structure (at the start, and again after each delink: `auto` re-selects the blocks). A
    model on the meta device is materialised part by part into its homes, from `seed` (the run's). Raises
    `ConfigError` for `offload: auto` without `offload_budget_gb` on a device other than CUDA (the configuration's
    rules refuse `offload_update: during_backward` with clipping before the run starts).
    """
    if args.offload is None:
        return None
    args.check_offload_budget(accelerator.device.type)  # ConfigError: `auto` with no device memory to plan for
    budget = None if args.offload_budget_gb is None else int(args.offload_budget_gb * 2**30)
    meta = any(param.is_meta for param in model.parameters())
    if meta and seed is None:
        raise ValueError("apply_offload: a model on the meta device is materialised from a seed: give seed")
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
        grad_accumulation=args.offload_grad_accumulation,
        accumulation_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.offload_grad_dtype]
        if args.offload_grad_accumulation == "device"
        else None,
        # Accelerate's `accumulate()` says before each forward whether its backward ends the step's accumulation.
        last_micro_batch=lambda: accelerator.sync_gradients,
        update=args.offload_update,
        delay_correction=args.offload_delay_correction,
        host_threads=args.offload_host_threads,
        # A model on the meta device: each part materialised straight into its home (`materialize`'s values).
        materialize=partial(_materialize_parts, model, seed) if meta else None,
    )


def _materialize_parts(model: nn.Module, seed: int, modules: list[nn.Module], device: torch.device) -> None:
    materialize(model, seed, keep=modules, device=device)


def measure_offload_activations(
    model: nn.Module, args: OffloadArguments, block_size: int, accelerator, batch_size: int
) -> int:
    """Activation bytes of one training micro-batch of `batch_size` blocks, for `offload: auto` (0 for other offload
    modes; `args`: the run's offload section).

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
    return measured * batch_size * block_size // tokens
