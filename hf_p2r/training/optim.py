"""The optimizer (AdamW) and the learning-rate schedule of a P2R run.

The learning rate is a pure function of the step (and of the delink steps), set on the optimizer before every
update: nothing to save or rebuild when the optimizer is replaced at a delink, and a resumed run gets it right.
"""

import functools
import math
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import get_wsd_schedule

from .carry import block_of
from .config import TrainArguments
from .offload import GranularOffload


def build_optimizer(
    model: nn.Module,
    args: TrainArguments,
    offload: GranularOffload | None = None,
    lr_scales: dict[int, float] | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices and embeddings, not on norms and biases.

    The single place where the optimizer is made: at the start, at every delink and when resuming. With granular
    `offload`, the offloaded blocks' part of each group steps on the CPU (`GranularOffload.build_optimizer`).
    torch's fused AdamW is used wherever it applies (not on FSDP2's DTensor shards), with or without offload, so
    the two give the same updates. Every group has an `lr_scale` (1 unless `shared_lr_scale: depth` divides a shared
    block's by the depths it runs at): the training loop sets each group's rate to the schedule's times it.
    `lr_scales` ({id(parameter): factor}) replaces the model's own where `model` holds a part of it (pipeline stages).
    """
    scale_of = shared_lr_scales(model, args) if lr_scales is None else lr_scales
    buckets: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            buckets.setdefault((param.ndim >= 2, scale_of.get(id(param), 1.0)), []).append(param)
    groups = [
        {"params": params, "weight_decay": args.weight_decay if decay else 0.0, "lr_scale": scale}
        for (decay, scale), params in sorted(buckets.items(), key=lambda item: (not item[0][0], -item[0][1]))
    ]
    options = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    if offload is not None:
        return offload.build_optimizer(groups, **options, fused=True)
    fused = not any(isinstance(p, DTensor) for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, **options, fused=fused or None)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set every group's rate to the schedule's `lr` times the group's `lr_scale`; returns the smallest rate set (a
    shared block's under `shared_lr_scale: depth`, else `lr`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return min(group["lr"] for group in optimizer.param_groups)


def shared_lr_scales(model, args: TrainArguments) -> dict[int, float]:
    """{id(parameter): learning-rate factor}: with `shared_lr_scale: depth`, 1/n for a block run at n depths of the
    whole model. `model`: a P2R model, or a pipeline's stages (their parameters under the model's names, the whole
    model's layout in `config`)."""
    if args.shared_lr_scale == "none":
        return {}
    uses = Counter(model.config.block_of_depth)
    return {
        id(param): 1.0 / uses[block]
        for name, param in model.named_parameters()
        if (block := block_of(name)) is not None
    }


def learning_rate_at(step: int, args: TrainArguments, delink_steps: list[int]) -> float:
    """Learning rate of the update from `step` to `step + 1` (steps count from 0).

    Linear warm-up over `warmup_steps`, then `lr_scheduler` decay to `min_lr_ratio * learning_rate` at the last step;
    the schedule runs over the whole run (pseudo and real steps). `wsd` holds the peak until the last
    `lr_decay_fraction` of the run (transformers' `get_wsd_schedule`, 1-sqrt decay): the delinks fall in its stable
    phase, and runs that differ before the decay are compared after the same anneal. With `lr_after_delink="rewarm"`
    the rate is also ramped up linearly over `rewarm_steps` after each step in `delink_steps`.
    """
    peak, warmup = args.learning_rate, args.warmup_steps
    if step < warmup:
        lr = peak * (step + 1) / warmup
    elif args.lr_scheduler == "wsd":
        # The decay's last factor (min_lr_ratio) lands on the last step, as cosine's and linear's do.
        lr = peak * _wsd_factor(warmup, args.decay_steps, args.total_steps - 1, args.min_lr_ratio)(step)
    else:
        progress = (step - warmup) / max(1, args.total_steps - 1 - warmup)
        decay = {
            "constant": 1.0,
            "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        }[args.lr_scheduler]
        floor = 1.0 if args.lr_scheduler == "constant" else args.min_lr_ratio
        lr = peak * (floor + (1.0 - floor) * decay)
    if args.lr_after_delink == "rewarm":
        since = [step - delink_step for delink_step in delink_steps if delink_step <= step]
        if since:
            lr *= min(1.0, (min(since) + 1) / args.rewarm_steps)
    return lr


@functools.cache
def _wsd_factor(warmup: int, decay: int, last_step: int, min_lr_ratio: float) -> Callable[[int], float]:
    """transformers' WSD factor of a step (its warm-up unused: every schedule here shares the one above)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_wsd_schedule(
        probe,
        num_warmup_steps=warmup,
        num_decay_steps=decay,
        num_training_steps=last_step,
        decay_type="1-sqrt",
        min_lr_ratio=min_lr_ratio,
    )
    return schedule.lr_lambdas[0]
