"""The one place hf-p2r reads what torch keeps private, each read written for every torch release pyproject allows.

A private attribute that moves between releases breaks here, with a test (tests/test_compat.py) run on the declared
floor and on the newest release by .ci/run, instead of somewhere in a training run.
"""

import torch


def reshard_after_backward(module: torch.nn.Module) -> bool:
    """FSDP2's `reshard_after_backward` of an FSDP2 unit: what `set_reshard_after_backward` last set (default True).

    FSDP2 has a setter and no getter. torch 2.12 turned the unit's one parameter group (`_fsdp_param_group`) into a
    list (`_fsdp_param_groups`); 2.11 has only the former.
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    if not groups:
        return True  # a unit that manages no parameters: nothing to reshard
    return all(group.reshard_after_backward for group in groups)


__all__ = ["reshard_after_backward"]
