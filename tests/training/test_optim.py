"""The learning-rate schedule over the whole run, with and without a re-warm after delinking."""

import math

import pytest

from hf_p2r.training import TrainArguments
from hf_p2r.training.optim import build_optimizer, learning_rate_at

from ..conftest import tiny_model


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
