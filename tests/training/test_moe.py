"""Mixture-of-experts runs: the YAML fields, the aux loss and router statistics in metrics.jsonl, the delink of expert
and router optimizer state."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_p2r import P2RMoeConfig, P2RMoeForCausalLM
from hf_p2r.training import TrainArguments, delink_with_optimizer, parse_config, train
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.optim import build_optimizer, optimizer_factory

from ..models.test_modeling_p2r_moe import moe_model
from .helpers import REPO, tiny_argv

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.01)


def test_demo_moe_yaml_builds_a_moe_model():
    config = parse_config(["--config", str(REPO / "configs" / "demo_moe.yaml")])
    model_config = config.p2r_config(vocab_size=256, num_blocks=config.initial_blocks(), special_tokens={})
    assert isinstance(model_config, P2RMoeConfig)
    assert (model_config.num_experts, model_config.num_experts_per_tok, model_config.num_unique_layers) == (4, 2, 2)
    dense = parse_config(["--config", str(REPO / "configs" / "demo.yaml")])
    assert type(dense.p2r_config(vocab_size=256, num_blocks=2, special_tokens={})).__name__ == "P2RConfig"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_expert_groups=3), "num_expert_groups"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step"),  # k=1 shared block cannot be sparse at every 2nd depth
    ],
)
def test_bad_moe_fields_are_one_error_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        parse_config(tiny_argv(tmp_path, **{**MOE, **overrides}))


@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_delink_carries_expert_and_router_state(carry):
    model = moe_model(share_layers=True, num_unique_layers=2).train()
    optimizer = build_optimizer(model, TrainArguments())
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids, output_router_logits=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    names = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
    names += ("model.layers.1.mlp.gate.weight",)
    before = {
        name: {key: value.clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
        if name in names
    }
    new_optimizer = delink_with_optimizer(model, optimizer, None, carry, optimizer_factory(TrainArguments()))
    params = dict(model.named_parameters())
    for name in names:
        # Block 1 runs depths 1, 3, 5, 7 (cycle): new block 7 is one of its copies.
        state = new_optimizer.state.get(params[name.replace("layers.1.", "layers.7.")], {})
        if carry == "reset":
            assert state == {}
            continue
        scale = 1 if carry == "copy" else 4
        assert torch.equal(state["exp_avg"], before[name]["exp_avg"] / scale)
        assert torch.equal(state["exp_avg_sq"], before[name]["exp_avg_sq"] / scale**2)


def test_moe_run_logs_router_statistics_per_stage_and_delinks(tmp_path):
    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, **MOE, num_unique_layers=2, pseudo_steps=2, real_steps=2, save_steps=0)
    assert train(parse_config(argv)) == 0
    records = [r for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["stage"]) for r in records] == [(1, "pseudo"), (2, "pseudo"), (3, "real"), (4, "real")]
    for record in records:
        assert len(record["expert_load"]) == 4 and abs(sum(record["expert_load"]) - 1) < 1e-4
        assert record["expert_load_cv"] >= 0 and record["aux_loss"] > 0
    real = AutoModelForCausalLM.from_pretrained(output_dir / "real")
    assert type(real) is P2RMoeForCausalLM and len(real.model.layers) == 4
    # pseudo/ (2 blocks, each with router and experts) delinks on load into the model the real stage started from.
    pseudo = AutoModelForCausalLM.from_pretrained(output_dir / "pseudo").eval()
    started = P2RMoeForCausalLM.from_pretrained(output_dir / "pseudo", share_layers=False).eval()
    ids = torch.arange(3, 35).unsqueeze(0)
    assert len(pseudo.model.layers) == 2 and torch.equal(started(ids).logits, pseudo(ids).logits)
