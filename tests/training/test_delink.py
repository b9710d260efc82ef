"""Delinking in training: the optimizer state each `optimizer_carry` gives the new parameters, value by value."""

import pytest
import torch
from accelerate import Accelerator

from hf_p2r.training import TrainArguments, delink_in_training, delink_with_optimizer
from hf_p2r.training.optim import build_optimizer

from ..conftest import tiny_model

NON_LAYER = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _trained(steps=2, **model_overrides):
    """A pseudo model after a few AdamW steps, and a snapshot of the optimizer state by parameter name."""
    model = tiny_model(share_layers=True, **model_overrides).train()
    optimizer = build_optimizer(model, TrainArguments())
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    snapshot = {
        name: {key: value.clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }
    return model, optimizer, snapshot


def _source(name: str, block_of_new: dict[int, int]) -> str:
    parts = name.split(".")
    if parts[1] != "layers":
        return name
    return ".".join([*parts[:2], str(block_of_new[int(parts[2])]), *parts[3:]])


@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_full_delink_carries_state_per_mode(carry):
    # L=8, k=2, cycle: new block j comes from block j % 2, which served 4 depths.
    model, optimizer, before = _trained(num_hidden_layers=8, num_unique_layers=2)
    new_optimizer = delink_with_optimizer(model, optimizer, None, TrainArguments(optimizer_carry=carry))

    params = dict(model.named_parameters())
    assert {id(p) for group in new_optimizer.param_groups for p in group["params"]} == {id(p) for p in params.values()}
    for name, param in params.items():
        state = new_optimizer.state.get(param, {})
        old = before[_source(name, {j: j % 2 for j in range(8)})]
        if name in NON_LAYER or carry == "copy":
            expected = old
        elif carry == "reset":
            expected = {}
        else:
            expected = {"step": old["step"], "exp_avg": old["exp_avg"] / 4, "exp_avg_sq": old["exp_avg_sq"] / 16}
        assert state.keys() == expected.keys(), name
        for key in expected:
            assert torch.equal(state[key], expected[key]), (name, key)
    # Copies own their state: the next step must not write one copy's moments into another's.
    first, second = params["model.layers.0.mlp.up_proj.weight"], params["model.layers.2.mlp.up_proj.weight"]
    if carry != "reset":
        assert new_optimizer.state[first]["exp_avg"].data_ptr() != new_optimizer.state[second]["exp_avg"].data_ptr()


def test_scale_uses_the_depths_each_block_served():
    # sequence, L=5, k=2: block_of_depth = [0, 0, 0, 1, 1], so block 0 served 3 depths and block 1 served 2.
    model, optimizer, before = _trained(num_hidden_layers=5, num_unique_layers=2, sharing_pattern="sequence")
    assert model.config.block_of_depth == [0, 0, 0, 1, 1]
    new_optimizer = delink_with_optimizer(model, optimizer, None, TrainArguments(optimizer_carry="scale"))
    for depth, (source_block, served) in enumerate([(0, 3), (0, 3), (0, 3), (1, 2), (1, 2)]):
        param = model.model.layers[depth].self_attn.q_proj.weight
        old = before[f"model.layers.{source_block}.self_attn.q_proj.weight"]
        assert torch.equal(new_optimizer.state[param]["exp_avg"], old["exp_avg"] * (1 / served))
        assert torch.equal(new_optimizer.state[param]["exp_avg_sq"], old["exp_avg_sq"] * (1 / served) ** 2)


def test_partial_delink_scales_by_the_ratio_of_depths_served():
    # cycle, L=8: 1 block (8 depths each) -> 2 blocks (4 depths each): r = 4 / 8.
    model, optimizer, before = _trained(num_hidden_layers=8, num_unique_layers=1)
    new_optimizer = delink_with_optimizer(model, optimizer, 2, TrainArguments(optimizer_carry="scale"))
    assert model.config.num_unique_layers == 2
    for block in range(2):
        param = model.model.layers[block].mlp.down_proj.weight
        old = before["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(new_optimizer.state[param]["exp_avg"], old["exp_avg"] / 2)
        assert torch.equal(new_optimizer.state[param]["exp_avg_sq"], old["exp_avg_sq"] / 4)


def test_carried_state_changes_the_next_update():
    """Control: the modes are not equivalent, so the value tests above distinguish real behaviour."""
    updates = {}
    for carry in ("reset", "copy", "scale"):
        model, optimizer, _ = _trained(num_hidden_layers=8, num_unique_layers=2)
        new_optimizer = delink_with_optimizer(model, optimizer, None, TrainArguments(optimizer_carry=carry))
        ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(2))
        weight = model.model.layers[5].mlp.up_proj.weight
        before = weight.detach().clone()
        model(ids, labels=ids).loss.backward()
        new_optimizer.step()
        updates[carry] = weight.detach() - before
    assert not torch.allclose(updates["reset"], updates["copy"])
    assert not torch.allclose(updates["copy"], updates["scale"])


@pytest.mark.parametrize("blocks", [4, None])  # cycle, L=8, k=2 -> 4 blocks (r = 2 / 4) or -> 8 (r = 1 / 4)
@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_delink_in_training_carries_state_per_mode(carry, blocks):
    """The trainer's path: a model and optimizer prepared by Accelerate, delinked between two optimizer steps."""
    accelerator = Accelerator(cpu=True)
    model, optimizer, before = _trained(num_hidden_layers=8, num_unique_layers=2)
    non_layer = {name: param for name, param in model.named_parameters() if name in NON_LAYER}
    model, optimizer = accelerator.prepare(model, optimizer)
    args = TrainArguments(optimizer_carry=carry)
    model, optimizer, _ = delink_in_training(accelerator, model, optimizer, blocks, args)

    after = blocks or 8
    ratio = (8 / after) / 4  # depths each new block runs at / depths the old block ran at (4 of 8)
    state = optimizer.optimizer.state
    params = dict(accelerator.unwrap_model(model).named_parameters())
    assert len([name for name in params if name.endswith("mlp.up_proj.weight")]) == after
    for name, param in params.items():
        old = before[_source(name, {j: j % 2 for j in range(after)})]  # cycle: new block j copies old block j % 2
        if name in NON_LAYER:
            assert param is non_layer[name]  # the same parameter, with the same state values
            expected = old
        elif carry == "reset":
            expected = {}
        elif carry == "copy":
            expected = old
        else:
            expected = {
                "step": old["step"],
                "exp_avg": old["exp_avg"] * ratio,
                "exp_avg_sq": old["exp_avg_sq"] * ratio**2,
            }
        assert state.get(param, {}).keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(state[param][key], value), (name, key)


def test_delink_in_training_leaves_accelerate_with_only_the_new_pair():
    accelerator = Accelerator(cpu=True)
    model, optimizer, _ = _trained(num_hidden_layers=8, num_unique_layers=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model, optimizer, offload = delink_in_training(accelerator, model, optimizer, None, TrainArguments())
    assert offload is None
    assert accelerator._models == [model] and accelerator._optimizers == [optimizer]
    assert len(model.model.layers) == 8
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
