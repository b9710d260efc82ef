"""The delay correction shared by the schedules whose update uses a one-step-stale gradient (PipeDream-2BW's
`pipeline_delay_correction`, granular offload's `update="delayed"`): error feedback, after arXiv 2606.30634's
section 3 (the rule is stated and derived in `hf_p2r.distributed.pipeline.pipedream`'s docstring).

With d(t) the update the optimizer just made from the stale gradient (the weights after its step minus before, weight
decay included) and d(t-1) the one before, the weights receive e(t-1) = d(t) - d(t-1) on top of d(t):
W(t+1) = W(t) + d(t) + (d(t) - d(t-1)); the first update (no d(t-1)) is applied as it is.
"""

import torch

__all__ = ["DELAY_CORRECTIONS", "feed_back_error_"]

DELAY_CORRECTIONS = ("none", "error_feedback")


@torch.no_grad()
def feed_back_error_(param: torch.Tensor, before: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Add d(t) - d(t-1) to `param` in place, d(t) = `param` - `before` (the step just made), d(t-1) = `previous`
    (None at the first update: nothing added). Returns d(t), the next call's `previous`."""
    update = param - before
    if previous is not None:
        param.add_(update - previous)
    return update
