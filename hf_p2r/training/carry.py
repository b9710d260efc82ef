"""The optimizer-state carry across a delink: the one rule every engine applies (a whole model under Accelerate, FSDP2
shards, a pipeline's stages), depth growth included (a grown layer is a copy of the layer it copies: its block's).

How the optimizer state of a block's copies starts (`optimizer_carry`):

- `reset`: fresh state, as if the copies were new parameters (Adam's bias correction restarts for them).
- `copy`: each copy takes the shared parameter's `exp_avg`, `exp_avg_sq` and `step`.
- `scale`: like `copy`, with `exp_avg * r` and `exp_avg_sq * r**2`, r = n' / n, where the old block ran at n depths and
  the copy runs at n'. A shared parameter's gradient is the sum of its n per-depth gradients, so each copy's own
  gradient is about r times the shared one; scaling keeps Adam's moments on the scale of the gradients to come
  (for a full delink, r = 1 / n). Adam's update m / sqrt(v) is unchanged at the first step.

Muon (`optimizer: muon`, `hf_p2r.training.optim.MuonAdamW`) keeps one `momentum_buffer` B per matrix, torch's
B <- mu B + (1 - mu) g, a running mean of past gradients, linear in them; its update is the orthogonalized
(Newton–Schulz) mu B + (1 - mu) g (Nesterov). The same three rules follow: `reset` starts B at zero for the copies
(Muon has no step count or bias correction to restart); `copy` gives each copy the shared matrix's B; `scale` gives it
B * r with the same r = n' / n, because each copy's own gradient is about r times the shared one and B is linear in
the gradients: the copies' first update then mixes the carried momentum and their new gradient in the proportion of
a step without a delink (`copy` weighs the carried momentum 1/r times more). Orthogonalization discards the overall
scale, so the update's size does not depend on the rule. AdamW's part of a `MuonAdamW` (embeddings, norms, head)
follows Adam's rules.

Parameters outside the transformer blocks (embeddings, final norm, head) keep their state in every mode.

Depth growth (d -> L' depths, `DelinkPlan`): n and n' count the depths of the model before and after, so stacking an
unshared d-layer model to L' gives r = 1 for every copy, and a 1-block model run at d depths grown to L' real layers
r = 1/d. Function-preserving growth's zeroed output projections are copies too and follow the same rule (`reset` is
the usual pair: the copies' first update then comes from their own gradients). `scale` counts depths only: under
Depth-µP the growth also changes the branch multiplier, and with it the scale of the gradients to come (by about
sqrt(d / L')), which the carried moments do not follow.

```python
before = ParameterSnapshot.of(model)  # a P2R model, or a pipeline's stages (`hf_p2r.distributed.pipeline.Pipeline`)
mapping = model.delink_parameter_map()
model.delink()
new_optimizer = torch.optim.AdamW(model.parameters())
carry_optimizer_state(optimizer, new_optimizer, before, ParameterSnapshot.of(model), mapping, "scale")
```
"""

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..models.p2r.sharing_p2r import LAYER_KEY

CARRIES = ("reset", "copy", "scale")


class _HasLayout(Protocol):
    config: object

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


@dataclass(frozen=True)
class ParameterSnapshot:
    """A model's parameters by name and how many depths run each of its blocks, on one side of a delink."""

    params: dict[str, nn.Parameter]  # model name -> parameter
    uses: Counter  # block -> depths of the whole model that run it

    @classmethod
    def of(cls, model: _HasLayout) -> "ParameterSnapshot":
        """The snapshot of `model`: anything with the model's parameter names and its config's `block_of_depth` (a P2R
        model, FSDP2-sharded or not, or a pipeline's stages, whose config is the whole model's layout)."""
        return cls(dict(model.named_parameters()), Counter(model.config.block_of_depth))


def block_of(name: str) -> int | None:
    """The block a parameter name belongs to (`model.layers.<block>.…`), None outside the blocks."""
    match = LAYER_KEY.match(name)
    return int(match["block"]) if match else None


def carry_optimizer_state(
    old_optimizer: torch.optim.Optimizer,
    new_optimizer: torch.optim.Optimizer,
    before: ParameterSnapshot,
    after: ParameterSnapshot,
    mapping: dict[str, str],
    carry: str,
) -> None:
    """Fill `new_optimizer` (over the delinked parameters, `after`) from `old_optimizer` (over `before`'s) per `carry`
    (reset, copy, scale; see the module docstring).

    `mapping` is {new name: old name} (`delink_parameter_map`, `delink_fully_sharded`, `delink_stages`). Each carried
    tensor is placed on its new parameter's device (offloaded parameters keep their state in CPU memory; DTensor
    shards stay as they are, laid out like their parameter).
    """
    if carry not in CARRIES:
        raise ValueError(f"optimizer_carry: {carry!r} is not one of {', '.join(CARRIES)}")
    for name, param in after.params.items():
        source = before.params[mapping[name]]
        state = old_optimizer.state.get(source)
        if not state:
            continue
        new_block = block_of(name)
        if new_block is None:  # outside the blocks: keeps its state in every mode
            new_optimizer.state[param] = {key: to_device(value, param) for key, value in state.items()}
        elif carry != "reset":
            ratio = 1.0
            if carry == "scale":
                ratio = after.uses[new_block] / before.uses[block_of(mapping[name])]
            new_optimizer.state[param] = scaled_state(state, ratio, param)
    # A state_dict round trip lets torch place each `step` where this optimizer's implementation wants it
    # (fused and capturable AdamW keep it on the parameter's device, the others on the CPU).
    new_optimizer.load_state_dict(new_optimizer.state_dict())


def to_device(value, param: nn.Parameter):
    """`value` on `param`'s device (DTensor shards stay as they are: they are laid out like their parameter)."""
    if torch.is_tensor(value) and value.ndim and value.device != param.device:
        return value.to(param.device)
    return value


def scaled_state(state: dict, ratio: float, param: nn.Parameter) -> dict:
    """A copy of one parameter's state with Adam's first moment and Muon's momentum buffer times `ratio`, Adam's
    second moment times `ratio**2`."""
    factors = {"exp_avg": ratio, "momentum_buffer": ratio, "exp_avg_sq": ratio**2, "max_exp_avg_sq": ratio**2}
    return {
        key: to_device(value * factors[key] if key in factors and ratio != 1.0 else value.clone(), param)
        for key, value in state.items()
    }


__all__ = ["CARRIES", "ParameterSnapshot", "block_of", "carry_optimizer_state", "scaled_state", "to_device"]
