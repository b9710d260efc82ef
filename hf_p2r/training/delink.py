"""Delinking during training: the model gets more blocks, and the optimizer follows.

`delink_with_optimizer` is plain PyTorch (testable alone); `delink_in_training` wraps it for a model and optimizer
prepared by Accelerate. How the Adam state of a block's copies starts (`optimizer_carry`):

- `reset`: fresh state, as if the copies were new parameters (Adam's bias correction restarts for them).
- `copy`: each copy takes the shared parameter's `exp_avg`, `exp_avg_sq` and `step`.
- `scale`: like `copy`, with `exp_avg * r` and `exp_avg_sq * r**2`, r = n' / n, where the old block ran at n depths and
  the copy runs at n'. A shared parameter's gradient is the sum of its n per-depth gradients, so each copy's own
  gradient is about r times the shared one; scaling keeps Adam's moments on the scale of the gradients to come
  (for a full delink, r = 1 / n). Adam's update m / sqrt(v) is unchanged at the first step.

Parameters outside the transformer blocks (embeddings, final norm, head) keep their state in every mode.
"""

from collections import Counter

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from ..models.p2r import P2RForCausalLM
from .config import TrainArguments
from .optim import build_optimizer

# Engines whose parameters and optimizer state are sharded or owned by the engine: delinking them needs a gather
# (or the engine's own checkpoint reshaping), which this module does not do yet.
UNSUPPORTED_ENGINES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def delink_with_optimizer(
    model: P2RForCausalLM, optimizer: torch.optim.Optimizer, num_unique_layers: int | None, args: TrainArguments
) -> torch.optim.AdamW:
    """Delink `model` in place to `num_unique_layers` blocks (None: the real model) and return a new optimizer over
    its parameters whose state is carried from `optimizer` according to `args.optimizer_carry`."""
    uses_before = Counter(model.config.block_of_depth)
    block_before = _block_of_parameter(model)
    old_params = dict(model.named_parameters())
    mapping = model.delink_parameter_map(num_unique_layers)  # new name -> current name, computed before delinking

    model.delink(num_unique_layers)

    uses_after = Counter(model.config.block_of_depth)
    block_after = _block_of_parameter(model)
    new_optimizer = build_optimizer(model, args)
    for name, param in model.named_parameters():
        source = old_params[mapping[name]]
        state = optimizer.state.get(source)
        if not state:
            continue
        if id(param) not in block_after:  # not in a transformer block: the same Parameter, the same state
            new_optimizer.state[param] = state
        elif args.optimizer_carry != "reset":
            ratio = 1.0
            if args.optimizer_carry == "scale":
                ratio = uses_after[block_after[id(param)]] / uses_before[block_before[id(source)]]
            new_optimizer.state[param] = _scaled_state(state, ratio)
    return new_optimizer


def _block_of_parameter(model: P2RForCausalLM) -> dict[int, int]:
    """{id(parameter): index of the block that holds it} for the parameters of the transformer blocks."""
    return {id(param): block for block, layer in enumerate(model.base_model.layers) for param in layer.parameters()}


def _scaled_state(state: dict, ratio: float) -> dict:
    """A copy of one parameter's Adam state with the first moment times `ratio`, the second times `ratio**2`."""
    factors = {"exp_avg": ratio, "exp_avg_sq": ratio**2, "max_exp_avg_sq": ratio**2}
    return {
        key: value * factors[key] if key in factors and ratio != 1.0 else value.clone() for key, value in state.items()
    }


def check_delink_supported(accelerator: Accelerator) -> None:
    """Raise `ValueError` up front when the run would delink under an engine this module cannot handle yet."""
    if accelerator.distributed_type in UNSUPPORTED_ENGINES:
        raise ValueError(
            f"pseudo_steps: delinking under {accelerator.distributed_type.value} is not supported yet; train the "
            "pseudo stage with DDP (or one device), or set pseudo_steps: 0"
        )


def delink_in_training(
    accelerator: Accelerator, model: nn.Module, optimizer, num_unique_layers: int | None, args: TrainArguments
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Delink the prepared `model` and rebuild the prepared `optimizer`; returns the newly prepared pair.

    Call it between optimizer steps (gradients zeroed). Under DDP the wrapper's gradient buckets list the old
    parameters, so the model is unwrapped, delinked and wrapped again. Accelerate keeps the prepared objects in
    `accelerator._models` / `_optimizers` (what `save_state` saves); its public `free_memory()` drops them (and
    resets `accelerator.step`, the gradient-accumulation counter, which is 0 modulo the accumulation steps between
    optimizer steps), so that afterwards Accelerate knows only the delinked pair. Mixed-precision forward wrappers
    are removed before and added again by `prepare`.
    """
    check_delink_supported(accelerator)
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's AcceleratedOptimizer
    accelerator.free_memory()
    new_optimizer = delink_with_optimizer(unwrapped, raw_optimizer, num_unique_layers, args)
    return accelerator.prepare(unwrapped, new_optimizer)
