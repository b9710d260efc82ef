"""The learning-rate schedule over the whole run, with and without a re-warm after delinking; parameter groups."""

import json
import math

import pytest

from hf_p2r.training import TrainArguments, parse_config, train
from hf_p2r.training.checkpointing import STATE_FILE, TrainState, read_state
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.optim import build_optimizer, learning_rate_at

from ..conftest import tiny_model
from .helpers import tiny_argv


def test_warmup_then_cosine_to_the_floor():
    args = TrainArguments(learning_rate=1.0, warmup_steps=4, pseudo_steps=10, real_steps=10, min_lr_ratio=0.1)
    assert [learning_rate_at(step, args, []) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate_at(4, args, []) == 1.0
    assert learning_rate_at(19, args, []) == pytest.approx(0.1)
    middle = 4 + (19 - 4) / 2
    assert learning_rate_at(int(middle), args, []) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))


def test_rewarm_ramps_up_after_each_delink_and_continue_does_not():
    common = dict(learning_rate=1.0, warmup_steps=0, pseudo_steps=10, real_steps=10, lr_scheduler="constant")
    rewarm = TrainArguments(lr_after_delink="rewarm", rewarm_steps=4, **common)
    assert [learning_rate_at(step, rewarm, [5, 10]) for step in range(4, 16)] == [
        1.0,
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        1.0,
    ]
    keep = TrainArguments(lr_after_delink="continue", **common)
    assert {learning_rate_at(step, keep, [5, 10]) for step in range(20)} == {1.0}


def test_no_weight_decay_on_norms():
    model = tiny_model()
    decay, no_decay = build_optimizer(model, TrainArguments(weight_decay=0.1)).param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(p.ndim == 1 for p in no_decay["params"]) and all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def _scales(optimizer) -> dict[int, float]:
    """{id(parameter): its group's lr_scale}."""
    return {id(p): group["lr_scale"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize(
    ("overrides", "uses"),
    [
        (dict(num_hidden_layers=8, num_unique_layers=2), [4, 4]),
        (dict(num_hidden_layers=8, num_unique_layers=1), [8]),
        (dict(num_hidden_layers=5, num_unique_layers=2, sharing_pattern="sequence"), [3, 2]),  # uneven
    ],
)
def test_shared_lr_scale_depth_divides_each_block_by_its_depths(overrides, uses):
    model = tiny_model(share_layers=True, **overrides)
    optimizer = build_optimizer(model, TrainArguments(weight_decay=0.1, shared_lr_scale="depth"))
    scales = _scales(optimizer)
    for block, n in enumerate(uses):
        assert {scales[id(p)] for p in model.model.layers[block].parameters()} == {1.0 / n}
    in_layers = {id(p) for p in model.model.layers.parameters()}
    assert {scales[id(p)] for p in model.parameters() if id(p) not in in_layers} == {1.0}  # embeddings, norm, head
    # Weight decay is still by shape, within every factor.
    for group in optimizer.param_groups:
        assert {p.ndim >= 2 for p in group["params"]} == {group["weight_decay"] == 0.1}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
    assert set(_scales(build_optimizer(model, TrainArguments(shared_lr_scale="none"))).values()) == {1.0}
    assert _scales(build_optimizer(model, TrainArguments())) == scales  # depth: the default


def test_shared_lr_scale_follows_partial_and_full_delinks():
    args = TrainArguments(shared_lr_scale="depth")
    model = tiny_model(share_layers=True, num_hidden_layers=8, num_unique_layers=1)
    assert set(_scales(build_optimizer(model, args)).values()) == {1.0, 1 / 8}
    model.delink(2)
    assert set(_scales(build_optimizer(model, args)).values()) == {1.0, 1 / 4}
    model.delink()
    decay, no_decay = build_optimizer(model, args).param_groups  # the real model: back to the two plain groups
    assert (decay["lr_scale"], no_decay["lr_scale"]) == (1.0, 1.0)


def test_depth_mup_scales_the_blocks_rate_by_the_models_block_lr_scale():
    """Depth-muP (the model's `depth_mup`): the blocks' groups take `config.block_lr_scale`, 1/sqrt(L) of the depth
    the model has now (times 1/n for a block shared over n depths), the embeddings, norm and head keep 1; a growth's
    new optimizer takes the new depth's; without depth_mup nothing changes."""
    model = tiny_model(num_hidden_layers=4, depth_mup=True)
    scales = _scales(build_optimizer(model, TrainArguments(shared_lr_scale="none")))
    in_layers = {id(p) for p in model.model.layers.parameters()}
    assert model.config.block_lr_scale == 0.5
    assert {scales[i] for i in in_layers} == {0.5}
    assert {scales[id(p)] for p in model.parameters() if id(p) not in in_layers} == {1.0}
    plain = tiny_model(num_hidden_layers=4)
    assert set(_scales(build_optimizer(plain, TrainArguments(shared_lr_scale="none"))).values()) == {1.0}

    shared = tiny_model(share_layers=True, num_hidden_layers=4, num_unique_layers=1, depth_mup=True)
    scales = _scales(build_optimizer(shared, TrainArguments(shared_lr_scale="depth")))
    assert {scales[id(p)] for p in shared.model.layers.parameters()} == {0.5 / 4}
    shared.delink(num_hidden_layers=16)  # grown: 16 real layers, 1/sqrt(16)
    scales = _scales(build_optimizer(shared, TrainArguments(shared_lr_scale="depth")))
    assert {scales[id(p)] for p in shared.model.layers.parameters()} == {0.25}


def test_training_steps_shared_blocks_at_the_scaled_rate_and_logs_it(tmp_path):
    argv = tiny_argv(tmp_path, num_unique_layers=2, pseudo_steps=2, real_steps=2, shared_lr_scale="depth")
    assert train(parse_config(argv)) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r]
    # 4 layers, 2 blocks: each runs at 2 depths, at half the rate until the delink; the real model has no shared block.
    assert [r["lr_shared"] for r in steps if r["stage"] == "pseudo"] == [r["lr"] / 2 for r in steps[:2]]
    assert not any("lr_shared" in r for r in steps if r["step"] > 2)


def test_resume_refuses_another_shared_lr_scale(tmp_path):
    saved = parse_config(["--shared_lr_scale", "none"])
    (tmp_path / STATE_FILE).write_text(json.dumps({"state": vars(TrainState()), "config": saved.to_dict()}))
    assert read_state(tmp_path, saved) == TrainState()
    with pytest.raises(ValueError, match=r"different run \(shared_lr_scale='none' there, 'depth' now\)$"):
        read_state(tmp_path, parse_config([]))


def test_wsd_warms_up_holds_the_peak_then_decays_to_the_floor():
    args = TrainArguments(
        learning_rate=2.0, warmup_steps=4, pseudo_steps=10, real_steps=10, lr_scheduler="wsd", lr_decay_fraction=0.25
    )
    rates = [learning_rate_at(step, args, [10]) for step in range(20)]
    assert rates[:4] == [0.5, 1.0, 1.5, 2.0]  # the same warm-up as every schedule
    decay = args.decay_steps
    assert decay == 5
    assert rates[4 : 19 - decay + 1] == [2.0] * (19 - decay - 3)  # stable: the peak, through the delink at step 10
    # 1-sqrt decay over the last 5 steps, to min_lr_ratio * peak at the last step.
    assert rates[19 - decay + 2] == pytest.approx(2.0 * (0.1 + 0.9 * (1 - math.sqrt(2 / 5))))
    assert rates[19] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(rates[14:], rates[15:]))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(lr_decay_fraction=0.0), "lr_decay_fraction"),
        (dict(lr_decay_fraction=1.5), "lr_decay_fraction"),
        (dict(lr_decay_fraction=0.9, warmup_steps=5), "lr_decay_fraction"),  # 5 + 18 > 20 steps
        (dict(lr_scheduler="step"), "lr_scheduler"),
    ],
)
def test_wsd_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        TrainArguments(pseudo_steps=10, real_steps=10, **{"lr_scheduler": "wsd", **overrides})
