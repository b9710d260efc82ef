"""`hf-p2r plan` for MoE models: memory follows all the experts, FLOPs the ones a token is routed to."""

import pytest

from hf_p2r.cli import main
from hf_p2r.planning import Hardware, Layout, estimate, parameter_tensors
from hf_p2r.planning.plan import pseudo_and_real, read_config

from ..models.test_modeling_p2r_moe import moe_config, moe_model
from .test_plan import workload


def test_parameter_tensors_count_every_expert_and_active_the_routed_ones():
    config = moe_config(num_experts=8, num_experts_per_tok=2)
    tensors = parameter_tensors(config)
    assert sum(t.numel for t in tensors) == sum(p.numel() for p in moe_model(num_experts=8).parameters())
    experts = sum(t.numel for t in tensors if ".mlp.experts." in t.name)
    assert experts == 8 * 8 * 3 * 48 * 32  # L x E x (gate, up, down) x moe_intermediate x hidden
    assert sum(t.active_numel for t in tensors) == sum(t.numel for t in tensors) - experts * 6 / 8


def test_more_experts_cost_memory_not_flops():
    small, large = moe_config(num_experts=4), moe_config(num_experts=16)
    a = estimate(small, Layout(dp=2), workload(), Hardware())
    b = estimate(large, Layout(dp=2), workload(), Hardware())
    assert b.memory.model_states > 3 * a.memory.model_states
    assert b.compute_seconds == pytest.approx(a.compute_seconds, rel=0.05)  # only the router grows
    assert b.memory.activations == pytest.approx(a.memory.activations, rel=0.05)  # and the router logits


def test_pseudo_and_real_moe_compute_the_same_activations_and_flops():
    pseudo, real = pseudo_and_real(moe_config(), num_unique_layers=2)
    a = estimate(pseudo, Layout(dp=2), workload(), Hardware())
    b = estimate(real, Layout(dp=2), workload(), Hardware())
    assert (a.memory.activations, a.compute_seconds) == (b.memory.activations, b.compute_seconds)
    assert a.memory.model_states < b.memory.model_states


def test_plan_command_prints_total_and_active_parameters(tmp_path, capsys):
    moe_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path)
    assert type(read_config(tmp_path).config).__name__ == "P2RMoeConfig"
    assert main(["plan", "--config", str(tmp_path), "--gpus", "2", "--gpu-memory", "4GiB", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "pseudo model: 2 stored blocks run at 8 depths (cycle), 49.9K parameters (31.5K active per token" in out
    assert "real model: 8 blocks, 180K parameters (106K active per token: top-2 of 4 experts)" in out
