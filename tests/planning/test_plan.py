"""Layouts, ranking and the `hf-p2r plan` command."""

import json
import re

import pytest

from hf_p2r.cli import main
from hf_p2r.commands.plan import read_plan_input
from hf_p2r.planning import (
    PRECISIONS,
    Hardware,
    Layout,
    Workload,
    estimate,
    parameter_tensors,
    pipeline_stages,
    plan,
)
from hf_p2r.planning.plan import pseudo_and_real, read_config
from hf_p2r.training.offload import offload_working_set_bytes

from ..conftest import tiny_config

GiB = 2**30


def workload(**overrides) -> Workload:
    return Workload(
        **{"seq_len": 64, "micro_batch": 2, "global_batch": 8, "precision": PRECISIONS["mixed"], **overrides}
    )


def test_fits_means_the_most_loaded_gpu_is_within_memory():
    config = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8)
    hardware = Hardware(gpu_memory=2 * GiB + 60 * 2**20, gpus_per_node=4)
    estimates = plan(config, 4, workload(), hardware, max_pp=4)
    fits = [e for e in estimates if e.fits]
    assert fits and len(fits) < len(estimates)  # the memory limit is neither trivially met nor impossible
    for e in estimates:
        assert e.fits == (e.memory.total + hardware.reserved_gpu_bytes <= hardware.gpu_memory)
    steps = [e.step_seconds for e in fits]
    assert steps == sorted(steps)
    assert all(not e.fits for e in estimates[len(fits) :])


def test_sharding_stages_shrink_model_states():
    config, hardware = tiny_config(), Hardware()
    states = [estimate(config, Layout(dp=4, zero=z), workload(), hardware).memory for z in range(4)]
    assert states[0].optimizer > states[1].optimizer == states[2].optimizer == states[3].optimizer
    assert states[1].grads > states[2].grads == states[3].grads
    assert states[2].weights > states[3].weights


def test_pseudo_and_real_compute_the_same_activations_and_flops():
    pseudo, real = pseudo_and_real(tiny_config(), num_unique_layers=2)
    for layout in (Layout(dp=2), Layout(dp=1, tp=2), Layout(dp=2, recompute=True)):
        a = estimate(pseudo, layout, workload(), Hardware())
        b = estimate(real, layout, workload(), Hardware())
        assert a.memory.activations == b.memory.activations
        assert a.compute_seconds == b.compute_seconds
        assert a.memory.model_states < b.memory.model_states


def test_gather_shared_once_keeps_the_shared_blocks_whole():
    """Under FSDP2 a shared block stays gathered all step (hf_p2r.distributed.gather_shared_once): its full weights and
    gradients are buffers, and it is gathered once per micro-batch instead of once forward and once backward."""
    pseudo, real = pseudo_and_real(tiny_config(), num_unique_layers=1)
    layout = Layout(dp=4, zero=3)
    p, r = (estimate(c, layout, workload(), Hardware()) for c in (pseudo, real))
    block = sum(t.numel for t in parameter_tensors(pseudo) if t.block == 0)
    assert p.memory.buffers >= block * (PRECISIONS["mixed"].weight + PRECISIONS["mixed"].grad)
    assert p.comm_seconds < r.comm_seconds


@pytest.mark.parametrize("pattern,expected", [("sequence", [(0, 1), (2, 3)]), ("cycle", [(0, 1, 2, 3), (0, 1, 2, 3)])])
def test_pipeline_stages_hold_the_blocks_their_depths_run(pattern, expected):
    config = tiny_config(share_layers=True, num_unique_layers=4, sharing_pattern=pattern)
    stages = pipeline_stages(config, 2)
    assert [stage.blocks for stage in stages] == expected
    assert [list(stage.depths) for stage in stages] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="pp=3 must divide num_hidden_layers"):
        pipeline_stages(config, 3)


def test_offload_moves_block_states_to_cpu():
    config, hardware = tiny_config(), Hardware(cpu_memory=10**12)
    base = estimate(config, Layout(dp=1), workload(), hardware)
    half = estimate(config, Layout(dp=1, offload=0.5), workload(), hardware)
    assert half.memory.model_states < base.memory.model_states
    assert half.memory.cpu == base.memory.model_states - half.memory.model_states
    assert half.offload_seconds > 0 == base.offload_seconds
    tight = estimate(config, Layout(dp=1, offload=0.5), workload(), Hardware(cpu_memory=half.cpu_per_node - 1))
    assert not tight.fits


def test_granular_offload_is_offered_only_where_the_trainer_runs_it():
    """`GranularOffload` runs in one process (the trainer and the class refuse several): its ratios are layouts on one
    GPU only; on several GPUs offload is FSDP2's or DeepSpeed's (ZeRO-3, all of the model)."""
    config, hardware = tiny_config(), Hardware(gpus_per_node=4)

    def granular(gpus):
        return [
            e for e in plan(config, gpus, workload(), hardware, max_pp=gpus) if e.layout.zero < 3 and e.layout.offload
        ]

    one = granular(1)
    assert sorted({e.layout.offload for e in one}) == [0.25, 0.5, 0.75, 1.0]
    assert all(e.layout.gpus == 1 and e.engine.startswith("one process, offload: ") for e in one)
    assert granular(2) == granular(4) == []
    several = plan(config, 4, workload(), hardware, max_pp=4)
    assert not any("GranularOffload" in e.engine for e in several)
    offloading = {e.engine for e in several if e.layout.offload and e.layout.tp == e.layout.pp == 1}
    assert offloading == {"fsdp2_offload.yaml or deepspeed_zero3_offload.yaml"}


@pytest.mark.parametrize("shared", [False, True], ids=["real", "pseudo"])
def test_offload_buffers_are_granular_offloads_working_set(shared):
    """The planner and `estimate_device_bytes` size the offloaded blocks' device working set with one function."""
    config = tiny_config(share_layers=True, num_unique_layers=2) if shared else tiny_config()
    p = PRECISIONS["mixed"]
    block = sum(t.numel for t in parameter_tensors(config) if t.block == 0)
    offloaded = config.num_blocks // 2
    expected = offload_working_set_bytes(
        block * p.weight, block * p.grad, offloaded=offloaded, shared=offloaded if shared else 0
    )
    assert estimate(config, Layout(dp=1, offload=0.5), workload(), Hardware()).memory.buffers == expected
    assert expected == (1 if shared else 2) * block * p.weight + (1 if shared else 2) * block * p.grad


def test_read_config_accepts_folders_json_and_trainer_yaml(tmp_path):
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path / "pseudo")
    assert read_config(tmp_path / "pseudo").config.num_blocks == 2
    assert read_config(tmp_path / "pseudo" / "config.json").config.share_layers

    llama = tiny_config().to_dict() | {"model_type": "llama"}
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    assert not read_config(tmp_path / "llama.json").config.share_layers

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "hidden_size: 64\nintermediate_size: 128\nnum_hidden_layers: 6\nnum_attention_heads: 4\n"
        "num_unique_layers: 2\nblock_size: 96\nper_device_batch_size: 3\nactivation_checkpointing: true\n"
    )
    found = read_plan_input(yaml_file)
    assert (found.config.num_hidden_layers, found.config.num_blocks, found.seq_len, found.micro_batch) == (6, 2, 96, 3)
    assert found.recompute and found.notes  # vocab_size unset: assumed, and said so


def test_plan_command_prints_both_models(tmp_path, capsys):
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path)
    assert main(["plan", "--config", str(tmp_path), "--gpus", "4", "--gpu-memory", "4GiB", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "pseudo model: 2 stored blocks run at 8 depths (cycle), 25.1K parameters" in out
    assert "real model: 8 blocks, 80.7K parameters" in out
    ranks = re.findall(r"^\| (\d+) +\| dp", out, flags=re.MULTILINE)
    assert ranks == [str(rank) for rank in range(1, 11)] * 2  # --top 10 rows per model


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config", "missing.json", "--gpus", "2"], "missing.json: no such file"),
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--gpus", "2", "--assume", "mfu=abc"], "'abc' is not a number"),
        (["--gpus", "2", "--assume", "speed=3"], "expected NAME=VALUE"),
        (["--gpus", "2", "--num-unique-layers", "8"], "num_unique_layers must satisfy"),
    ],
)
def test_plan_command_bad_input_is_one_line(tmp_path, capsys, argv, message):
    tiny_config().save_pretrained(tmp_path)
    if "--config" not in argv:
        argv = ["--config", str(tmp_path), *argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("hf-p2r plan: error:")


def test_bad_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type must be 'p2r', 'p2r_moe' or 'llama', got 'gpt2'"):
        read_config(tmp_path)
