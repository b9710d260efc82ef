"""Delinking during training: the model gets more blocks, and the optimizer follows.

`delink_with_optimizer` is plain PyTorch (testable alone); `delink_in_training` wraps it for a model and optimizer
prepared by Accelerate (one device, DDP, FSDP2, DeepSpeed) and for granular offload. How the Adam state of a block's
copies starts (`optimizer_carry`):

- `reset`: fresh state, as if the copies were new parameters (Adam's bias correction restarts for them).
- `copy`: each copy takes the shared parameter's `exp_avg`, `exp_avg_sq` and `step`.
- `scale`: like `copy`, with `exp_avg * r` and `exp_avg_sq * r**2`, r = n' / n, where the old block ran at n depths and
  the copy runs at n'. A shared parameter's gradient is the sum of its n per-depth gradients, so each copy's own
  gradient is about r times the shared one; scaling keeps Adam's moments on the scale of the gradients to come
  (for a full delink, r = 1 / n). Adam's update m / sqrt(v) is unchanged at the first step.

Parameters outside the transformer blocks (embeddings, final norm, head) keep their state in every mode.
"""

from collections import Counter
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from ..models.p2r import P2RForCausalLM
from .config import TrainArguments
from .offload import GranularOffload
from .optim import apply_offload, build_optimizer


@dataclass
class _Before:
    """What carrying the optimizer state needs to know of the model before it was delinked."""

    params: dict[str, nn.Parameter]  # name -> parameter
    uses: Counter  # block -> depths it ran at
    block_of: dict[int, int]  # id(parameter) -> block

    @classmethod
    def of(cls, model: P2RForCausalLM) -> "_Before":
        return cls(dict(model.named_parameters()), Counter(model.config.block_of_depth), _block_of_parameter(model))


def carry_optimizer_state(
    old_optimizer: torch.optim.Optimizer,
    new_optimizer: torch.optim.Optimizer,
    model: P2RForCausalLM,
    mapping: dict[str, str],
    before: _Before,
    carry: str,
) -> None:
    """Fill `new_optimizer` (over the delinked `model`) from `old_optimizer` per `carry` (reset, copy, scale).

    `mapping` is `delink_parameter_map` ({new name: old name}). Each carried tensor is placed on its new parameter's
    device, so offloaded parameters keep their state in CPU memory.
    """
    uses_after, block_after = Counter(model.config.block_of_depth), _block_of_parameter(model)
    for name, param in model.named_parameters():
        source = before.params[mapping[name]]
        state = old_optimizer.state.get(source)
        if not state:
            continue
        if id(param) not in block_after:  # outside the blocks: keeps its state in every mode
            new_optimizer.state[param] = {key: _to(value, param) for key, value in state.items()}
        elif carry != "reset":
            ratio = 1.0
            if carry == "scale":
                ratio = uses_after[block_after[id(param)]] / before.uses[before.block_of[id(source)]]
            new_optimizer.state[param] = _scaled_state(state, ratio, param)
    # A state_dict round trip lets torch place each `step` where this optimizer's implementation wants it
    # (fused and capturable AdamW keep it on the parameter's device, the others on the CPU).
    new_optimizer.load_state_dict(new_optimizer.state_dict())


def delink_with_optimizer(
    model: P2RForCausalLM, optimizer: torch.optim.Optimizer, num_unique_layers: int | None, args: TrainArguments
) -> torch.optim.Optimizer:
    """Delink `model` in place to `num_unique_layers` blocks (None: the real model) and return a new optimizer over
    its parameters whose state is carried from `optimizer` according to `args.optimizer_carry`."""
    before, mapping = _Before.of(model), model.delink_parameter_map(num_unique_layers)
    model.delink(num_unique_layers)
    new_optimizer = build_optimizer(model, args)
    carry_optimizer_state(optimizer, new_optimizer, model, mapping, before, args.optimizer_carry)
    return new_optimizer


def _block_of_parameter(model: P2RForCausalLM) -> dict[int, int]:
    """{id(parameter): index of the block that holds it} for the parameters of the transformer blocks."""
    return {id(param): block for block, layer in enumerate(model.base_model.layers) for param in layer.parameters()}


def _to(value, param: nn.Parameter):
    """`value` on `param`'s device (DTensor shards stay as they are: they are laid out like their parameter)."""
    if torch.is_tensor(value) and value.ndim and value.device != param.device:
        return value.to(param.device)
    return value


def _scaled_state(state: dict, ratio: float, param: nn.Parameter) -> dict:
    """A copy of one parameter's Adam state with the first moment times `ratio`, the second times `ratio**2`."""
    factors = {"exp_avg": ratio, "exp_avg_sq": ratio**2, "max_exp_avg_sq": ratio**2}
    return {
        key: _to(value * factors[key] if key in factors and ratio != 1.0 else value.clone(), param)
        for key, value in state.items()
    }


def check_delink_supported(accelerator: Accelerator, args: TrainArguments) -> None:
    """Raise `ValueError` up front when the run would delink under an engine this module cannot handle."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError("pseudo_steps: delinking under FSDP1 is not supported; use FSDP2 (fsdp_version: 2)")
    if kind == DistributedType.DEEPSPEED and args.optimizer_carry != "reset":
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
    num_unique_layers: int | None,
    args: TrainArguments,
    offload: GranularOffload | None = None,
    activation_bytes: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, GranularOffload | None]:
    """Delink the prepared `model` and rebuild the prepared `optimizer`; returns the newly prepared pair and the
    granular offload applied to the new model (None without `args.offload`).

    Call it between optimizer steps (gradients zeroed). Accelerate keeps the prepared objects in
    `accelerator._models` / `_optimizers` (what `save_state` saves); its public `free_memory()` drops them (and
    resets `accelerator.step`, the gradient-accumulation counter, which is 0 modulo the accumulation steps between
    optimizer steps), so that afterwards Accelerate knows only the delinked pair.

    - FSDP2: the sharded model is delinked without gathering it (`hf_p2r.distributed.delink_fully_sharded`: each rank
      copies its own shards), then sharded like the old one; the optimizer state is carried shard by shard.
    - DeepSpeed: the full fp32 weights are gathered, the model is delinked and a new engine is built; the optimizer
      state restarts (`optimizer_carry: reset`, checked up front).
    - One device or DDP: the model is unwrapped (DDP's gradient buckets list the old parameters), delinked in place
      and wrapped again. Under granular offload the hooks are removed first (every parameter back where it was),
      and the offload is applied again to the delinked model, re-selecting its blocks (`offload: auto` picks none
      while the model fits: the pseudo model trains on the GPU, the real one offloads just enough).
    """
    check_delink_supported(accelerator, args)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's AcceleratedOptimizer
    if accelerator.is_fsdp2:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        from ..distributed import delink_fully_sharded, gather_shared_once

        before = _Before.of(model)
        new_model, mapping = delink_fully_sharded(
            model, num_unique_layers, shard=lambda m: gather_shared_once(fsdp2_prepare_model(accelerator, m))
        )
        new_optimizer = build_optimizer(new_model, args)
        carry_optimizer_state(raw_optimizer, new_optimizer, new_model, mapping, before, args.optimizer_carry)
        accelerator.free_memory()
        return *accelerator.prepare(new_model, new_optimizer), None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from ..distributed import gather_deepspeed_model

        plain = gather_deepspeed_model(model).delink(num_unique_layers)  # a collective: every rank calls it
        accelerator.free_memory()
        return *accelerator.prepare(plain, build_optimizer(plain, args)), None

    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    # Unwrapping took off the mixed-precision (autocast) forward, but on one device the model itself still carries
    # Accelerate's "already prepared" mark, with which `prepare` below would hand it back unwrapped: the real stage
    # would run without autocast (fp32 activations against offloaded blocks' bf16 working copies: F.linear raised
    # "expected m1 and m2 to have the same dtype"; without offload, silently in fp32).
    vars(unwrapped).pop("_is_accelerate_prepared", None)
    accelerator.free_memory()
    if offload is not None:
        offload.remove()
    before, mapping = _Before.of(unwrapped), unwrapped.delink_parameter_map(num_unique_layers)
    unwrapped.delink(num_unique_layers)
    offload = apply_offload(unwrapped, args, accelerator, activation_bytes)
    new_optimizer = build_optimizer(unwrapped, args, offload)
    carry_optimizer_state(raw_optimizer, new_optimizer, unwrapped, mapping, before, args.optimizer_carry)
    placement = [False, False] if offload is not None else None
    return *accelerator.prepare(unwrapped, new_optimizer, device_placement=placement), offload
