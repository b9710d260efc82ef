"""P2RCallback's schedule, its checks and its checkpoint state, without training (milliseconds each)."""

import json

import pytest
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from hf_p2r.integrations import Delink, P2RCallback, P2RTrainer, p2r_trainer
from hf_p2r.integrations.callback import schedule_events
from hf_p2r.integrations.trainer import checkpoint_stage, rewarmed
from hf_p2r.training.optim import learning_rate_at

from ..conftest import tiny_model
from .helpers import p2r_config


@pytest.mark.parametrize(
    ("delink_at", "events"),
    [
        (300, [Delink(300)]),
        ({200: 4, 100: 2, 300: None}, [Delink(100, 2), Delink(200, 4), Delink(300)]),
        ([Delink(5, 2), Delink(9)], [Delink(5, 2), Delink(9)]),
        ([[5, 2], [9, None]], [Delink(5, 2), Delink(9)]),  # as trainer_state.json keeps it
        ({7: 4}, [Delink(7, 4)]),  # partial delinks only: the run ends pseudo
    ],
)
def test_the_schedule_is_an_ordered_list_of_events(delink_at, events):
    assert schedule_events(delink_at) == events


@pytest.mark.parametrize(
    ("delink_at", "message"),
    [
        ("300", "delink_at: give a step"),
        ([], "delink_at: the schedule is empty"),
        (0, "delink_at: steps must be integers >= 1"),
        (True, "delink_at: give a step"),
        ({5: 2, 3: None}, "delink_at: the delink to the real model (step 3) must be the last event"),
        ({5: 4, 9: 2}, "delink_at: the blocks after each delink must be integers that grow"),
        ({5: 1}, "delink_at: the blocks after each delink must be integers that grow"),
        ([Delink(5, 2), Delink(5)], "delink_at: steps must be integers >= 1, increasing; got 5 after 5"),
        ([[5, 2, 3]], "delink_at: steps must be integers"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(delink_at, message):
    with pytest.raises(ValueError) as error:
        P2RCallback(delink_at)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"carry": "keep"}, "carry: 'keep' is not one of reset, copy, scale"),
        ({"lr_after_delink": "restart"}, "lr_after_delink: 'restart' is not one of continue, rewarm"),
        ({"rewarm_steps": 0}, "rewarm_steps: must be an integer >= 1, got 0"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P2RCallback(10, **kwargs)


def test_the_check_refuses_what_the_model_or_run_cannot_follow():
    model = tiny_model(share_layers=True, num_unique_layers=2)  # 8 layers, cycle
    P2RCallback({3: 4, 6: None}).check(model, max_steps=10)
    with pytest.raises(ValueError, match=r"^delink_at: step 3: num_unique_layers=3 cannot be reached from 2"):
        P2RCallback({3: 3, 6: None}).check(model, max_steps=10)
    with pytest.raises(ValueError, match=r"^delink_at: step 10 is at or after the run's end \(max_steps 10\)"):
        P2RCallback(10).check(model, max_steps=10)
    with pytest.raises(ValueError, match=r"^model: P2RCallback delinks a P2R model .* got Linear"):
        P2RCallback(3).check(__import__("torch").nn.Linear(2, 2), max_steps=10)
    # A resumed model past some events: those are skipped, the rest checked from its blocks.
    P2RCallback({3: 4, 6: None}).check(tiny_model(share_layers=True, num_unique_layers=4), max_steps=10)


def test_from_config_follows_hf_p2rs_own_schedule(tmp_path):
    config = p2r_config(
        tmp_path, pseudo_steps=6, partial_delink_blocks=[2], optimizer_carry="copy", lr_after_delink="rewarm"
    )
    callback = P2RCallback.from_config(config)
    assert callback.events == [Delink(3, 2), Delink(6)]  # even_delink_steps, then the real model at pseudo_steps
    assert (callback.carry, callback.lr_after_delink, callback.rewarm_steps) == ("copy", "rewarm", 20)


def test_the_checkpoint_state_rebuilds_the_callback():
    callback = P2RCallback({4: 2, 8: None}, carry="reset", lr_after_delink="rewarm", rewarm_steps=3)
    callback.num_blocks = 2
    state = json.loads(json.dumps(callback.state()))  # what trainer_state.json holds
    rebuilt = P2RCallback.from_state(state)
    assert isinstance(callback, ExportableState)
    assert (rebuilt.events, rebuilt.carry, rebuilt.lr_after_delink, rebuilt.rewarm_steps, rebuilt.num_blocks) == (
        callback.events,
        "reset",
        "rewarm",
        3,
        2,
    )


def test_a_checkpoints_stage_comes_from_its_trainer_state_else_its_config(tmp_path):
    state = {"stateful_callbacks": {"P2RCallback": {"args": {}, "attributes": {"num_blocks": 2}}}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))  # saved before growth: blocks only
    (tmp_path / "config.json").write_text(json.dumps({"share_layers": False, "num_hidden_layers": 8}))
    assert checkpoint_stage(str(tmp_path)) == (8, 2)
    state["stateful_callbacks"]["P2RCallback"]["attributes"] = {"num_hidden_layers": 4, "num_blocks": 2}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_stage(str(tmp_path)) == (4, 2)
    (tmp_path / "trainer_state.json").write_text("{}")  # a run without the callback
    assert checkpoint_stage(str(tmp_path)) == (8, 8)
    config = {"share_layers": True, "num_hidden_layers": 8, "num_unique_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_stage(str(tmp_path)) == (8, 4)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"^resume_from_checkpoint: .* does not say which stage it belongs to"):
        checkpoint_stage(str(tmp_path))


def test_rewarm_is_hf_p2rs_rule_on_top_of_the_schedule(tmp_path):
    args = p2r_config(tmp_path, lr_after_delink="rewarm", rewarm_steps=4, pseudo_steps=10, real_steps=10).train
    delinks = [3, 10]
    factor = rewarmed(lambda step: 1.0, delinks, 4)  # constant schedule: the factor is hf-p2r's rate / peak
    expected = [learning_rate_at(step, args, delinks) / args.learning_rate for step in range(20)]
    assert [factor(step) for step in range(20)] == pytest.approx(expected, rel=1e-12)  # (peak * f) / peak
    assert [factor(step) for step in (2, 3, 4, 6, 10, 13)] == [1.0, 0.25, 0.5, 1.0, 0.25, 1.0]


def test_p2r_trainer_puts_the_mixin_in_front_of_any_trainer_class():
    class MyTrainer(Trainer):
        pass

    made = p2r_trainer(MyTrainer)
    assert made is p2r_trainer(MyTrainer) and made.__name__ == "P2RMyTrainer" and issubclass(made, MyTrainer)
    assert made.__mro__[1].__name__ == "P2RTrainerMixin"
    assert p2r_trainer(P2RTrainer) is P2RTrainer
    with pytest.raises(TypeError, match="p2r_trainer: expects transformers.Trainer or a subclass"):
        p2r_trainer(dict)
