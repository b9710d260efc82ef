"""The optimizer (AdamW) and the learning-rate schedule of a P2R run.

The learning rate is a pure function of the step (and of the delink steps), set on the optimizer before every
update: nothing to save or rebuild when the optimizer is replaced at a delink, and a resumed run gets it right.
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import TrainArguments
from .offload import GranularOffload, measure_activation_bytes


def build_optimizer(
    model: nn.Module, args: TrainArguments, offload: GranularOffload | None = None
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices and embeddings, not on norms and biases.

    The single place where the optimizer is made: at the start, at every delink and when resuming. With granular
    `offload`, the offloaded blocks' part of each group steps on the CPU (`GranularOffload.build_optimizer`).
    torch's fused AdamW is used wherever it applies (not on FSDP2's DTensor shards), with or without offload, so
    the two give the same updates.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    options = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    if offload is not None:
        return offload.build_optimizer(groups, **options, fused=True)
    fused = not any(isinstance(p, DTensor) for p in decay + no_decay)
    return torch.optim.AdamW(groups, **options, fused=fused or None)


def apply_offload(model: nn.Module, args: TrainArguments, accelerator, activation_bytes: int = 0):
    """Granular CPU offload of `args.offload` blocks of `model` onto `accelerator.device`, or None without it.

    Apply it to the final structure (at the start, and again after each delink: `auto` re-selects the blocks).
    """
    if args.offload is None:
        return None
    budget = None if args.offload_budget_gb is None else int(args.offload_budget_gb * 2**30)
    return GranularOffload(
        model,
        args.offload_spec,
        device=accelerator.device,
        prefetch=args.offload_prefetch,
        compute_dtype=torch.bfloat16 if accelerator.mixed_precision == "bf16" else None,
        budget_bytes=budget,
        activation_bytes=activation_bytes,
    )


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
