"""The optimizer (AdamW, or Muon for the blocks' matrices with AdamW for the rest) and the learning-rate schedule of
a P2R run.

The learning rate is a pure function of the step (and of the delink steps), set on the optimizer before every
update: nothing to save or rebuild when the optimizer is replaced at a delink, and a resumed run gets it right.
"""

import functools
import math
from collections import Counter
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import get_wsd_schedule

from ..config import ConfigError, LearningRateSchedule, OptimizerArguments
from .carry import block_of
from .offload import GranularOffload


def build_optimizer(
    model: nn.Module,
    args: OptimizerArguments,
    offload: GranularOffload | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer over the trainable parameters of `model` (a P2R model, or a pipeline's stages: anything
    with the model's parameter names); weight decay on matrices and embeddings, not on norms and biases.

    `optimizer: adamw`: torch's AdamW. `optimizer: muon`: one `MuonAdamW`, torch's Muon for the blocks' matrices
    (`muon_parameters`), torch's AdamW for the rest. The single place where the optimizer is made: at the start, at
    every delink and when resuming. With granular `offload`, the offloaded blocks' part of each group steps on the CPU
    on their host masters (`GranularOffload.build_optimizer`; Muon's Newton–Schulz too). torch's fused AdamW is used
    wherever it applies (not on FSDP2's DTensor shards), with or without offload, so the two give the same updates.
    Every group has an `lr_scale` (1 unless `shared_lr_scale: depth` divides a shared block's by the depths it runs
    at, or the model's `depth_mup` scales the blocks' by its `block_lr_scale`: `shared_lr_scales`; a Muon group's also
    carries `muon_learning_rate / learning_rate`): the training loop sets each group's rate to
    the schedule's times it (a pipeline's stages: by the whole model's layout, `shared_lr_scales`).
    """
    scale_of = shared_lr_scales(model, args)
    muon = muon_parameters(model) if args.optimizer == "muon" else set()
    muon_ratio = (args.muon_learning_rate or args.learning_rate) / args.learning_rate
    buckets: dict[tuple[str, bool, float], list[nn.Parameter]] = {}
    for _, param in model.named_parameters():
        if param.requires_grad:
            algorithm = "muon" if id(param) in muon else "adamw"
            buckets.setdefault((algorithm, is_matrix(param), scale_of.get(id(param), 1.0)), []).append(param)
    groups = [
        {
            "params": params,
            "weight_decay": args.weight_decay if decay else 0.0,
            "lr_scale": scale * (muon_ratio if algorithm == "muon" else 1.0),
            **({"algorithm": algorithm} if muon else {}),
        }
        for (algorithm, decay, scale), params in sorted(
            buckets.items(), key=lambda item: (item[0][0] != "muon", not item[0][1], -item[0][2])
        )
    ]
    options = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    if muon:
        options |= dict(momentum=args.muon_momentum, adjust_lr_fn=args.muon_adjust_lr_fn)
    fused = not any(isinstance(p, DTensor) for group in groups for p in group["params"])
    optimizer_cls = MuonAdamW if muon else torch.optim.AdamW
    if offload is not None:
        return offload.build_optimizer(groups, optimizer_cls=optimizer_cls, **options, fused=True)
    return optimizer_cls(groups, **options, fused=fused or None)


OptimizerFactory = Callable[..., torch.optim.Optimizer]  # (model, offload=None) -> a new optimizer


def optimizer_factory(args: OptimizerArguments) -> OptimizerFactory:
    """`build_optimizer` with the run's optimizer section bound: `factory(model, offload=None)` builds each new
    optimizer (at the start, at every delink) for an engine or a delink that does not read the section itself."""

    def new_optimizer(model: nn.Module, offload: GranularOffload | None = None) -> torch.optim.Optimizer:
        return build_optimizer(model, args, offload)

    return new_optimizer


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters `optimizer: muon` gives to Muon: the blocks' matrices (attention and MLP projections,
    an MoE block's router) and an MoE block's 3-D expert tensors (one matrix per expert). Embeddings, the head, norms
    and biases stay on AdamW. `model`: anything with the model's parameter names (a P2R model or a pipeline)."""
    return {id(param) for name, param in model.named_parameters() if block_of(name) is not None and is_matrix(param)}


def is_matrix(param: nn.Parameter) -> bool:
    """Whether the parameter has two dimensions or more as the model declares it: DeepSpeed ZeRO-3 holds a partitioned
    parameter as an empty tensor and keeps its shape in `ds_shape` (the engine builds the optimizer on partitions)."""
    return len(getattr(param, "ds_shape", param.shape)) >= 2


def check_optimizer_supported(accelerator: Accelerator, optimizer: str) -> None:
    """Raise `ConfigError` up front where `optimizer: muon` (the run's `optimizer`) cannot run: its Newton–Schulz step
    needs each matrix whole, and FSDP (FSDP2's DTensor rows) and DeepSpeed's ZeRO (flat partitions) hand the optimizer
    shards. Gathering each matrix for its step is not implemented: the refusal says so in one line."""
    kind = accelerator.distributed_type
    if optimizer == "muon" and kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(f"optimizer: muon {MUON_NEEDS_WHOLE} ({kind.value}); use optimizer: adamw there")


MUON_NEEDS_WHOLE = "orthogonalizes each matrix whole (Newton-Schulz), and this engine hands the optimizer shards of it"


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer holding Muon groups and AdamW groups: each group's `algorithm` ("muon" or "adamw") says which of
    torch's implementations steps it (`torch.optim.Muon`, `torch.optim.AdamW`, called on this optimizer's own groups
    and `state`), so Accelerate's `prepare`, checkpoints, the delink's carry, offload and the pipelined schedules see
    one optimizer whose `state_dict` round-trips exactly.

    A Muon group takes 2-D matrices, and 3-D tensors whose first dimension indexes independent matrices (an MoE
    block's experts, (experts, out, in)): each expert is orthogonalized and scaled on its own, exactly as
    `torch.optim.Muon` over one parameter per expert, its state one `momentum_buffer` shaped like the tensor. Muon
    keeps one buffer per matrix (B <- mu B + g), AdamW two moments per parameter.

    `lr`, `weight_decay` are both algorithms' (a group overrides them); `betas`, `eps`, `fused` are AdamW's;
    `momentum`, `nesterov`, `ns_coefficients`, `ns_steps`, `adjust_lr_fn` are Muon's (its Newton–Schulz epsilon is
    torch's default).

    >>> muon = [p for n, p in model.named_parameters() if ".layers." in n and p.ndim >= 2]
    >>> rest = [p for p in model.parameters() if all(p is not q for q in muon)]
    >>> optimizer = MuonAdamW([{"params": muon, "algorithm": "muon"}, {"params": rest}], lr=3e-4)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] | None = None,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ):
        probe = [torch.zeros(1, 1, requires_grad=True)]
        adamw = torch.optim.AdamW(probe, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused)
        muon_options = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        if ns_coefficients is not None:
            muon_options["ns_coefficients"] = ns_coefficients
        muon = torch.optim.Muon(probe, lr=lr, weight_decay=weight_decay, **muon_options)
        self._inner = {"adamw": adamw, "muon": muon}
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        filled = []
        for group in groups:
            algorithm = group.get("algorithm", "adamw")
            if algorithm not in self._inner:
                raise ValueError(f"MuonAdamW: a group's algorithm must be muon or adamw, got {algorithm!r}")
            filled.append({**self._inner[algorithm].defaults, **group, "algorithm": algorithm})
        super().__init__(filled, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                for param in group["params"]:
                    _check_muon_parameter(param)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for algorithm, inner in self._inner.items():
            groups = [group for group in self.param_groups if group["algorithm"] == algorithm]
            if not groups:
                continue
            if algorithm == "adamw":
                inner.param_groups, inner.state = groups, self.state
            else:
                inner.param_groups, inner.state = self._muon_matrices(groups)
            inner.step()
        return loss

    def _muon_matrices(self, groups: list[dict]) -> tuple[list[dict], dict]:
        """torch's Muon's groups and state for this step: a 2-D parameter as itself (its state this optimizer's), a
        3-D one as one view per expert, of the parameter, its gradient and its momentum buffer (Muon updates all three
        in place, so the parameter and this optimizer's buffer get them)."""
        state, matrices = {}, []
        for group in groups:
            params = []
            for param in group["params"]:
                _check_muon_parameter(param)
                if param.grad is None:
                    continue
                if param.ndim == 2:
                    state[param] = self.state[param]
                    params.append(param)
                    continue
                own = self.state[param]
                if "momentum_buffer" not in own:
                    own["momentum_buffer"] = torch.zeros_like(param)
                weight = param.detach()
                for expert in range(param.shape[0]):
                    view = weight[expert]
                    view.grad = param.grad[expert]
                    state[view] = {"momentum_buffer": own["momentum_buffer"][expert]}
                    params.append(view)
            matrices.append({**group, "params": params})
        return matrices, state


def _check_muon_parameter(param: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        raise ConfigError(f"optimizer: muon {MUON_NEEDS_WHOLE} (an FSDP2 DTensor); use optimizer: adamw there")
    if param.ndim not in (2, 3):
        raise ConfigError(
            f"optimizer: muon takes matrices (2-D, or 3-D experts), got a {param.ndim}-D tensor {tuple(param.shape)}: "
            f"Muon {MUON_NEEDS_WHOLE} (DeepSpeed's ZeRO flattens them)"
        )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set every group's rate to the schedule's `lr` times the group's `lr_scale`; returns the smallest rate set (a
    shared block's under `shared_lr_scale: depth`, else `lr`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return min(group["lr"] for group in optimizer.param_groups)


def shared_lr_scales(model, args: OptimizerArguments) -> dict[int, float]:
    """{id(parameter): learning-rate factor} of the blocks' parameters: with `shared_lr_scale: depth`, 1/n for a block
    run at n depths of the whole model; under the model's `depth_mup`, times its `block_lr_scale` (1/sqrt(L) of the
    depth the model has now, TP VI's eta/sqrt(L): a depth growth's new optimizer takes the new depth's). `model`: a P2R
    model, or a pipeline's stages (their parameters under the model's names, the whole model's layout in `config`)."""
    config = model.config
    depth_scale = config.block_lr_scale if getattr(config, "depth_mup", False) else 1.0
    uses = Counter(config.block_of_depth) if args.shared_lr_scale == "depth" else None
    if uses is None and depth_scale == 1.0:
        return {}
    return {
        id(param): depth_scale / (uses[block] if uses is not None else 1)
        for name, param in model.named_parameters()
        if (block := block_of(name)) is not None
    }


def learning_rate_at(step: int, args: LearningRateSchedule, delink_steps: list[int]) -> float:
    """Learning rate of the update from `step` to `step + 1` (steps count from 0).

    Linear warm-up over `warmup_steps`, then `lr_scheduler` decay to `min_lr_ratio * learning_rate` at the schedule's
    last step: the schedule spans the whole run (pseudo and real steps) unless `lr_schedule_steps` says otherwise (a
    resumed run extended past the schedule's end runs on at its final rate). `wsd` holds the peak until the last
    `lr_decay_fraction` of the run (transformers' `get_wsd_schedule`, 1-sqrt decay): the delinks fall in its stable
    phase, and runs that differ before the decay are compared after the same anneal. With `lr_after_delink="rewarm"`
    the rate is also ramped up linearly over `rewarm_steps` after each step in `delink_steps`.
    """
    peak, warmup, last = args.learning_rate, args.warmup_steps, args.schedule_steps - 1
    at = min(step, last)  # past the schedule's end: its final rate
    if at < warmup:
        lr = peak * (at + 1) / warmup
    elif args.lr_scheduler == "wsd":
        # The decay's last factor (min_lr_ratio) lands on the last step, as cosine's and linear's do.
        lr = peak * _wsd_factor(warmup, args.decay_steps, last, args.min_lr_ratio)(at)
    else:
        progress = (at - warmup) / max(1, last - warmup)
        decay = {
            "constant": 1.0,
            "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        }[args.lr_scheduler]
        floor = 1.0 if args.lr_scheduler == "constant" else args.min_lr_ratio
        lr = peak * (floor + (1.0 - floor) * decay)
    if args.lr_after_delink == "rewarm":
        lr *= rewarm_factor(step, delink_steps, args.rewarm_steps)
    return lr


def rewarm_factor(step: int, delink_steps: list[int], rewarm_steps: int) -> float:
    """`lr_after_delink: rewarm`'s factor on the rate of the update from `step`: (steps since the last delink at or
    before `step`, + 1) / `rewarm_steps`, at most 1 (1 before the first delink)."""
    since = [step - delink_step for delink_step in delink_steps if delink_step <= step]
    return min(1.0, (min(since) + 1) / rewarm_steps) if since else 1.0


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
