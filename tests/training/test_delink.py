"""Delinking in training: the optimizer state each `optimizer_carry` gives the new parameters, value by value."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from hf_p2r.training import TrainArguments, delink_in_training, delink_with_optimizer
from hf_p2r.training.optim import build_optimizer, optimizer_factory

from ..conftest import tiny_model

NON_LAYER = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
ADAMW = optimizer_factory(TrainArguments())  # the new optimizer of a delink in training: the default AdamW


def _trained(steps=2, **model_overrides):
    """A pseudo model after a few AdamW steps, and a snapshot of the optimizer state by parameter name."""
    model = tiny_model(share_layers=True, **model_overrides).train()
    optimizer = build_optimizer(model, TrainArguments())
    return model, optimizer, _steps(model, optimizer, steps)


def _steps(model, optimizer, steps: int) -> dict:
    """`steps` optimizer steps on a fixed batch; then the optimizer state by parameter name, cloned."""
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        name: {key: value.clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }


def _source(name: str, block_of_new: dict[int, int]) -> str:
    parts = name.split(".")
    if parts[1] != "layers":
        return name
    return ".".join([*parts[:2], str(block_of_new[int(parts[2])]), *parts[3:]])


@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_full_delink_carries_state_per_mode(carry):
    # L=8, k=2, cycle: new block j comes from block j % 2, which served 4 depths.
    model, optimizer, before = _trained(num_hidden_layers=8, num_unique_layers=2)
    new_optimizer = delink_with_optimizer(model, optimizer, None, carry, ADAMW)

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
    new_optimizer = delink_with_optimizer(model, optimizer, None, "scale", ADAMW)
    for depth, (source_block, served) in enumerate([(0, 3), (0, 3), (0, 3), (1, 2), (1, 2)]):
        param = model.model.layers[depth].self_attn.q_proj.weight
        old = before[f"model.layers.{source_block}.self_attn.q_proj.weight"]
        assert torch.equal(new_optimizer.state[param]["exp_avg"], old["exp_avg"] * (1 / served))
        assert torch.equal(new_optimizer.state[param]["exp_avg_sq"], old["exp_avg_sq"] * (1 / served) ** 2)


def test_partial_delink_scales_by_the_ratio_of_depths_served():
    # cycle, L=8: 1 block (8 depths each) -> 2 blocks (4 depths each): r = 4 / 8.
    model, optimizer, before = _trained(num_hidden_layers=8, num_unique_layers=1)
    new_optimizer = delink_with_optimizer(model, optimizer, 2, "scale", ADAMW)
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
        new_optimizer = delink_with_optimizer(model, optimizer, None, carry, ADAMW)
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
    model, optimizer, _ = delink_in_training(accelerator, model, optimizer, blocks, carry, ADAMW)

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
    model, optimizer, offload = delink_in_training(accelerator, model, optimizer, None, "scale", ADAMW)
    assert offload is None
    assert accelerator._models == [model] and accelerator._optimizers == [optimizer]
    assert len(model.model.layers) == 8
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_delink_in_training_under_bf16_keeps_the_models_forward_and_autocast():
    """Under mixed precision Accelerate wraps the forward in autocast; unwrapping it with `keep_fp32_wrapper=False`
    alone followed `__wrapped__` past the model's own `can_return_tuple` (then `return_dict=False` raised
    AttributeError on a tuple). After the delink the model computes in bf16 again and still returns a tuple."""
    # Accelerate keeps one process-wide state whose mixed precision is fixed once set (as its own test case, reset
    # before and after).
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model, optimizer, _ = _trained(num_hidden_layers=8, num_unique_layers=2)
        model, optimizer = accelerator.prepare(model, optimizer)
        model, optimizer, _ = delink_in_training(accelerator, model, optimizer, None, "scale", ADAMW)
        input_ids = torch.randint(0, model.config.vocab_size, (1, 8))
        output = model(input_ids, return_dict=False)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert isinstance(output, tuple)
    plain = accelerator.unwrap_model(model)
    assert len(plain.model.layers) == 8
    fp32 = type(plain).forward(plain, input_ids).logits  # the class's forward: no autocast
    assert not torch.equal(output[0], fp32)  # autocast again (Accelerate hands the logits back in fp32)
    assert torch.allclose(output[0], fp32, atol=0.1)


# Depth growth is a delink along the depths: the same carries.


def _trained_shallow(optimizer="adamw", steps=2, **model_overrides):
    """A shallow model (real depth 4) after a few steps, and a snapshot of the optimizer state by parameter name."""
    args = TrainArguments(optimizer=optimizer, learning_rate=1e-2)
    model = tiny_model(real_num_hidden_layers=4, **model_overrides).train()
    optimizer = build_optimizer(model, args)
    return model, optimizer, _steps(model, optimizer, steps), args


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
@pytest.mark.parametrize(("layout", "ratio"), [({}, 1.0), (dict(share_layers=True, num_unique_layers=1), 0.5)])
def test_growth_carries_state_per_mode(optimizer, carry, layout, ratio):
    """2 -> 4 layers, stacked: layer j copies layer j % 2. Unshared, each copy runs at 1 depth as its source did
    (scale's r = 1); one shared block run at 2 depths, grown to 4 real layers, r = 1 / 2."""
    model, old_optimizer, before, args = _trained_shallow(optimizer, num_hidden_layers=2, **layout)
    plan = model.delink_plan(growth="stack")
    new_optimizer = delink_with_optimizer(model, old_optimizer, plan, carry, optimizer_factory(args))
    assert (model.config.num_hidden_layers, len(model.model.layers)) == (4, 4)
    sources = {j: j % 2 if not layout else 0 for j in range(4)}
    for name, param in model.named_parameters():
        old, state = before[_source(name, sources)], new_optimizer.state.get(param, {})
        if name in NON_LAYER or carry == "copy":
            expected = old
        elif carry == "reset":
            expected = {}
        else:
            factors = {"exp_avg": ratio, "momentum_buffer": ratio, "exp_avg_sq": ratio**2}
            expected = {key: value * factors[key] if key in factors else value for key, value in old.items()}
        assert state.keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(state[key], value), (name, key)


@pytest.mark.parametrize("growth", ["stack", "interleave"])
def test_function_preserving_growth_in_training_keeps_the_loss_then_trains_every_layer(growth):
    model, optimizer, _, args = _trained_shallow(num_hidden_layers=2, attention_bias=True)
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    plan = model.delink_plan(growth=growth, function_preserving=True)
    optimizer = delink_with_optimizer(model, optimizer, plan, args.optimizer_carry, optimizer_factory(args))
    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids).loss, loss)
    zeroed = [layer.self_attn.o_proj.weight for depth, layer in enumerate(model.model.layers) if depth in plan.fresh]
    assert zeroed and not any(weight.any() for weight in zeroed)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(weight.any() for weight in zeroed), "the zeroed output projections learn from the first step"


def test_delink_in_training_grows_a_model_prepared_by_accelerate():
    accelerator = Accelerator(cpu=True)
    model, optimizer, before, args = _trained_shallow(num_hidden_layers=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    plan = accelerator.unwrap_model(model).delink_plan(growth="interleave")
    model, optimizer, _ = delink_in_training(accelerator, model, optimizer, plan, "copy", optimizer_factory(args))
    grown = accelerator.unwrap_model(model)
    assert grown.config.num_hidden_layers == 4 and accelerator._models == [model]
    weight = grown.model.layers[1].mlp.up_proj.weight  # interleave: layer 1 copies layer 0
    assert torch.equal(
        optimizer.optimizer.state[weight]["exp_avg"], before["model.layers.0.mlp.up_proj.weight"]["exp_avg"]
    )
