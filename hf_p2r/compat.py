"""The one place hf-p2r reads what torch and the Hugging Face libraries keep private.

Each read is written for every release pyproject.toml allows; tests/test_compat.py runs them on the declared floors
and on the newest releases (.ci/run's compatibility pass), so a private name that moves breaks here, with a test,
instead of somewhere in a training run. No torch at import: the converter's fast path imports this module.
"""

from huggingface_hub.serialization._base import parse_size_to_int  # "5GB" -> bytes, as save_pretrained reads it

__all__ = ["in_backward", "parse_size_to_int", "reshard_after_backward"]


def reshard_after_backward(module) -> bool:
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


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (e.g. an activation-checkpointed block being recomputed)."""
    import torch

    return torch._C._current_graph_task_id() != -1
