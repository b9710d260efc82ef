"""The optimizer (AdamW) and the learning-rate schedule of a P2R run.

The learning rate is a pure function of the step (and of the delink steps), set on the optimizer before every
update: nothing to save or rebuild when the optimizer is replaced at a delink, and a resumed run gets it right.
"""

import math

import torch
from torch import nn

from .config import TrainArguments


def build_optimizer(model: nn.Module, args: TrainArguments) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices and embeddings, not on norms and biases.

    The single place where the optimizer is made: at the start, at every delink and when resuming.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
    )


def learning_rate_at(step: int, args: TrainArguments, delink_steps: list[int]) -> float:
    """Learning rate of the update from `step` to `step + 1` (steps count from 0).

    Linear warm-up over `warmup_steps`, then `lr_scheduler` decay to `min_lr_ratio * learning_rate` at the last step;
    the schedule runs over the whole run (pseudo and real steps). With `lr_after_delink="rewarm"` the rate is also
    ramped up linearly over `rewarm_steps` after each step in `delink_steps`.
    """
    peak, warmup = args.learning_rate, args.warmup_steps
    if step < warmup:
        lr = peak * (step + 1) / warmup
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
