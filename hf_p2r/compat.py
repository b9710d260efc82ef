"""The one place hf-p2r reads what torch and the Hugging Face libraries keep private.

Each read is written for every release pyproject.toml allows; tests/test_compat.py runs them on the declared floors
and on the newest releases (.ci/run's compatibility pass), so a private name that moves breaks here, with a test,
instead of somewhere in a training run. No torch at import: the converter's fast path imports this module.
"""

from huggingface_hub.serialization._base import parse_size_to_int  # "5GB" -> bytes, as save_pretrained reads it

__all__ = [
    "in_backward",
    "initialize_pipeline_stage",
    "parse_size_to_int",
    "pipeline_order",
    "reshard_after_backward",
]


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


def pipeline_order(schedule: str, stages: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """torch.distributed.pipelining's own compute actions of `schedule` (a `get_schedule_class` name: "GPipe",
    "1F1B", "Interleaved1F1B", ...) for `stages` ranks, as (kind, stage, micro-batch) per rank, in the order each
    rank runs them; REDUCE_GRAD and idle steps left out.

    The schedule classes expose their order as `pipeline_order` (a list of `_Action`) only once built on a stage;
    `_schedule_visualizer.get_schedule_ops` builds them on a mocked `PipelineStage` (no process group needed).
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return [
        [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in rank
            if a is not None and a.microbatch_index is not None and a.is_compute_op
        ]
        for rank in get_schedule_ops(schedule, stages, microbatches)
    ]


def initialize_pipeline_stage(schedule, slots: int, args, kwargs, target) -> None:
    """Set up the stage of a `PipelineScheduleSingle` subclass for `slots` micro-batch slots (P2P warm-up, shape
    inference, receive buffers): torch's own `_initialize_stage`, which sizes the buffers by the schedule's private
    `_n_microbatches` (PipeDream-2BW keeps micro-batches in flight across steps in 2m slots)."""
    schedule._n_microbatches = slots
    schedule._initialize_stage(args, kwargs, target)
