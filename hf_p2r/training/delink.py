"""Delinking during training: the model gets more blocks (or more depths: growth is a delink along the depths), and
the optimizer follows (`carry.py`, the one carry).

`delink_with_optimizer` is plain PyTorch (testable alone); `delink_in_training` wraps it for a model and optimizer
prepared by Accelerate (one device, DDP, FSDP2, DeepSpeed) and for granular offload; `delink_pipeline` does it for a
pipeline's stages (`hf_p2r.distributed.pipeline.delink_stages` changes their structure).

Each takes the delink as `num_unique_layers` (an int, or None for the real model) or as a `DelinkPlan`
(`model.delink_plan(k, num_hidden_layers=..., growth=..., function_preserving=...)`), which also grows the depth, under
every engine: one device, DDP and granular offload in place; FSDP2 and DeepSpeed ZeRO-3 shard by shard, no process
gathering the model (`delink_fully_sharded`, `delink_deepspeed`); pipelines where each stage can grow its own layers
("interleave" growth, or the whole model as one stage; otherwise refused in one line before anything changes:
`hf_p2r.distributed.pipeline.split.grown_split`).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from ..compat import forget_preparation, restore_forward
from ..distributed import delink_fully_sharded, gather_shared_once
from ..distributed.deepspeed import delink_deepspeed
from ..models.p2r import P2RForCausalLM
from ..models.p2r.sharing_p2r import DelinkPlan
from .carry import ParameterSnapshot, carry_optimizer_state
from .offload import GranularOffload
from .optim import OptimizerFactory

if TYPE_CHECKING:  # (a pipeline's modules, torch.distributed.pipelining's among them, load where a pipeline runs)
    from ..distributed.pipeline import Pipeline


def delink_with_optimizer(
    model: P2RForCausalLM,
    optimizer: torch.optim.Optimizer,
    num_unique_layers: int | DelinkPlan | None,
    carry: str,
    new_optimizer: OptimizerFactory,
) -> torch.optim.Optimizer:
    """Delink `model` in place to `num_unique_layers` blocks (None: the real model; a `DelinkPlan`: that delink, depth
    growth included) and return a new optimizer over its parameters (`new_optimizer(model)`: the run's,
    `optimizer_factory(config.optim)`) whose state is carried from `optimizer` according to `carry` (the run's
    `optimizer_carry`; a grown layer's parameters carry the state of the layer they copy, like any copy)."""
    before, mapping = ParameterSnapshot.of(model), model.delink_parameter_map(num_unique_layers)
    model.delink(num_unique_layers)
    rebuilt = new_optimizer(model)
    carry_optimizer_state(optimizer, rebuilt, before, ParameterSnapshot.of(model), mapping, carry)
    return rebuilt


def check_delink_supported(accelerator: Accelerator, carry: str) -> None:
    """Raise `ValueError` up front when the run would delink under an engine this module cannot handle (`carry`: the
    run's `optimizer_carry`)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError("pseudo_steps: delinking under FSDP1 is not supported; use FSDP2 (fsdp_version: 2)")
    if kind == DistributedType.DEEPSPEED and carry != "reset":
        raise ValueError(
            "optimizer_carry: under DeepSpeed the optimizer state lives in flat ZeRO partitions with no per-parameter "
            "carry; use optimizer_carry: reset (or FSDP2, which carries it)"
        )
    if kind == DistributedType.MEGATRON_LM:
        raise ValueError("pseudo_steps: delinking under Megatron-LM is not supported; use FSDP2 or DeepSpeed")


def delink_in_training(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer,
    num_unique_layers: int | DelinkPlan | None,
    carry: str,
    new_optimizer: OptimizerFactory,
    offload: GranularOffload | None = None,
    place: Callable[[nn.Module], GranularOffload | None] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, GranularOffload | None]:
    """Delink the prepared `model` and rebuild the prepared `optimizer`; returns the newly prepared pair and the
    granular offload applied to the new model (None without `place`).

    The new optimizer is `new_optimizer(model, offload)` (the run's: `optimizer_factory(config.optim)`; transformers'
    Trainer builds its own: `hf_p2r.integrations`); its state is carried from `optimizer` by `carry` (the run's
    `optimizer_carry`). `offload` is the granular offload of `model`, `place(model)` applies it to the delinked model
    (`apply_offload` with the run's offload section).

    Call it between optimizer steps (gradients zeroed). Accelerate keeps the prepared objects (what `save_state`
    saves: `hf_p2r.compat.prepared_models`); its public `free_memory()` drops them (and resets `accelerator.step`, the
    gradient-accumulation counter, which is 0 modulo the accumulation steps between optimizer steps), so that
    afterwards Accelerate knows only the delinked pair.

    - FSDP2: the sharded model is delinked without gathering it (`hf_p2r.distributed.delink_fully_sharded`: each rank
      copies its own shards), then sharded like the old one; the optimizer state is carried shard by shard.
    - DeepSpeed: the model is delinked from the full fp32 weights and a new engine is built (ZeRO-3: straight into
      the new model's partitions, one module at a time: `delink_deepspeed`); the optimizer state restarts
      (`optimizer_carry: reset`, checked up front).
    - One device or DDP: the model is unwrapped (DDP's gradient buckets list the old parameters), delinked in place
      and wrapped again. Under granular offload the hooks are removed first (every parameter back where it was),
      and the offload is applied again to the delinked model, re-selecting its blocks (`offload: auto` picks none
      while the model fits: the pseudo model trains on the GPU, the real one offloads just enough).
    """
    check_delink_supported(accelerator, carry)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's AcceleratedOptimizer
    if accelerator.is_fsdp2:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        before = ParameterSnapshot.of(model)
        new_model, mapping = delink_fully_sharded(
            model, num_unique_layers, shard=lambda m: gather_shared_once(fsdp2_prepare_model(accelerator, m))
        )
        rebuilt = new_optimizer(new_model, None)
        after = ParameterSnapshot.of(new_model)
        carry_optimizer_state(raw_optimizer, rebuilt, before, after, mapping, carry)
        accelerator.free_memory()
        return *accelerator.prepare(new_model, rebuilt), None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        plain = delink_deepspeed(model, num_unique_layers)  # a collective: every rank calls it
        accelerator.free_memory()
        return *accelerator.prepare(plain, new_optimizer(plain, None)), None

    # Mixed precision's autocast forward off as Accelerate found the forward: `keep_fp32_wrapper=False` alone would
    # follow `__wrapped__` past the model's own decorators (`can_return_tuple`) and past a forward patched on the
    # instance (TRL's fused LM head).
    restore_forward(accelerator.unwrap_model(model))
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    # Unwrapping took off the mixed-precision (autocast) forward, but on one device the model itself still carries
    # Accelerate's "already prepared" mark, with which `prepare` below would hand it back unwrapped: the real stage
    # would run without autocast (fp32 activations against offloaded blocks' bf16 working copies: F.linear raised
    # "expected m1 and m2 to have the same dtype"; without offload, silently in fp32).
    forget_preparation(unwrapped)
    accelerator.free_memory()
    if offload is not None:
        offload.remove()
    before, mapping = ParameterSnapshot.of(unwrapped), unwrapped.delink_parameter_map(num_unique_layers)
    unwrapped.delink(num_unique_layers)
    offload = place(unwrapped) if place is not None else None
    rebuilt = new_optimizer(unwrapped, offload)
    after = ParameterSnapshot.of(unwrapped)
    carry_optimizer_state(raw_optimizer, rebuilt, before, after, mapping, carry)
    placement = [False, False] if offload is not None else None
    return *accelerator.prepare(unwrapped, rebuilt, device_placement=placement), offload


def delink_pipeline(
    pipeline: "Pipeline",
    optimizer: torch.optim.Optimizer,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    carry: str,
    num_unique_layers: int | DelinkPlan | None = None,
) -> torch.optim.Optimizer:
    """Delink this process's stages (`delink_stages`, to `num_unique_layers` blocks; None: the real model) and return
    a new optimizer over their parameters (also `pipeline.optimizer`), its state carried from `optimizer` as for a
    whole model (`carry_optimizer_state`: scale's ratio n'/n counts every depth of the whole model that runs the new
    block and ran the old one). Call it on every process of every pipeline at the same step, between optimizer
    steps. (A schedule that keeps a second weight version, 2BW, is drained first and delinks it alike.) A depth growth
    the stages cannot do in place is refused in one line before any weight changes (`delink_stages`)."""
    from ..distributed.pipeline import delink_stages

    pipeline.drain()  # the optimizer's last update lands in the weights the snapshot holds
    before = ParameterSnapshot.of(pipeline)
    mapping = delink_stages(pipeline, num_unique_layers)
    new_optimizer = optimizer_factory(pipeline.parameters())
    carry_optimizer_state(optimizer, new_optimizer, before, ParameterSnapshot.of(pipeline), mapping, carry)
    pipeline.optimizer = new_optimizer
    return new_optimizer


__all__ = [
    "check_delink_supported",
    "delink_in_training",
    "delink_pipeline",
    "delink_with_optimizer",
]
