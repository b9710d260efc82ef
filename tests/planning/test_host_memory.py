"""The planner's host memory per process of a CPU run (`host_memory_per_process`, printed by `hf-p2r plan`): the
terms it adds, its state share against the planner's own per-GPU model-state count in fp32, and the line the plan
prints. How close it comes to measured runs is benchmarks/scale.md's (scripts/bench_scale.py prints each margin)."""

import re

import pytest

from hf_p2r.cli import main
from hf_p2r.planning import (
    PRECISIONS,
    Layout,
    block_parameters,
    host_memory_per_process,
    model_state_bytes,
    parameter_tensors,
    real_parameters,
)
from hf_p2r.planning.report import host_memory_line

from ..conftest import tiny_config

P, BLOCK = 164_258_816, 13_633_536  # benchmarks/scale.md's ~170M model and its largest block


def test_one_process_holds_the_whole_state_and_one_optimizer_temporary():
    memory = host_memory_per_process(P, 1)
    assert (memory.state, memory.gathered, memory.temporary) == (16 * P, 0, 4 * P)
    assert memory.total == 20 * P


def test_fsdp2_over_n_holds_its_share_and_a_block_gathered_with_its_gradient_and_the_next_one():
    memory = host_memory_per_process(P, 4, block_parameters=BLOCK)
    assert (memory.state, memory.gathered, memory.temporary) == (16 * P // 4, 12 * BLOCK, 4 * P // 4)


def test_a_sharded_pipeline_stage_gathers_one_block_at_a_time():
    """2 stages x 4 sharded replicas: a share of 1/8 of the state and the blocks gathered as by FSDP2 over the whole
    model (each micro-batch's backward reshards and reduce-scatters: `ShardedPipelineStage`)."""
    memory = host_memory_per_process(P, 8, stages=2, block_parameters=BLOCK)
    assert (memory.state, memory.gathered, memory.temporary) == (2 * P, 12 * BLOCK, P // 2)


def test_replicated_stages_hold_their_whole_stage():
    memory = host_memory_per_process(P, 4, stages=2, sharded=False, block_parameters=BLOCK)
    assert (memory.state, memory.gathered, memory.temporary) == (8 * P, 0, 2 * P)


def test_processes_must_be_a_multiple_of_the_stages():
    with pytest.raises(ValueError, match=r"^processes: 6 is not a multiple of the 4 pipeline stages$"):
        host_memory_per_process(P, 6, stages=4)


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_the_state_share_is_the_planners_fsdp2_model_state_in_fp32(processes):
    """The same count as the per-GPU figures: weights, gradients and AdamW's moments of a ZeRO-3 layout in fp32, up to
    FSDP2's rounding of each tensor's first dimension (at most one row per tensor) and AdamW's step counters."""
    config = tiny_config(hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    tensors = parameter_tensors(config)
    gpu = model_state_bytes(tensors, Layout(dp=processes, zero=3), PRECISIONS["fp32"])
    host = host_memory_per_process(real_parameters(config), processes).state
    slack = sum(16 * t.numel // t.shape[0] + 8 for t in tensors)  # a row per tensor, a counter per tensor
    assert abs(gpu.model_states - host) <= slack


def test_block_parameters_is_the_largest_stored_block():
    config = tiny_config(hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    tensors = parameter_tensors(config)
    layer0 = sum(t.numel for t in tensors if t.name.startswith("model.layers.0."))
    assert block_parameters(tensors) == layer0
    assert block_parameters([t for t in tensors if t.block is None]) == 0


def test_the_plan_prints_each_layouts_host_memory(tmp_path, capsys):
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path)
    assert main(["plan", "--config", str(tmp_path), "--gpus", "8", "--gpu-memory", "4GiB", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("host memory per process"))
    tensors = parameter_tensors(tiny_config())  # the real model of that pseudo model
    assert line == host_memory_line(tensors, 8)
    figures = dict(re.findall(r"(FSDP2 over 8|2 stages x 4 sharded|one process) (\d+ MiB)", line))
    params, block = real_parameters(tiny_config()), block_parameters(tensors)
    expected = {
        "FSDP2 over 8": host_memory_per_process(params, 8, block_parameters=block),
        "2 stages x 4 sharded": host_memory_per_process(params, 8, stages=2, block_parameters=block),
        "one process": host_memory_per_process(params, 1),
    }
    assert figures == {name: f"{memory.total / 2**20:.0f} MiB" for name, memory in expected.items()}


def test_a_run_of_one_process_prints_one_figure():
    line = host_memory_line(parameter_tensors(tiny_config()), 1)
    assert line.startswith("host memory per process of a CPU run of the real model on 1 process (")
    assert line.count(" MiB") == 1 and "FSDP2" not in line
