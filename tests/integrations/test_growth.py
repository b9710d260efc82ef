"""Depth growth inside transformers' Trainer (P2RCallback's `growth=`, issue 39's shallow stages) in one CPU process on
a tiny model: the weights mapped bitwise (`stack`, `interleave`), the function kept (`function_preserving`: the loss at
the growth step equal to the run that does not grow), the optimizer state carried, the learning rate rewarmed, the
depth in logs and checkpoints, resume from either side of a growth bitwise, bf16 autocast on the grown model, and the
schedule's one-line refusals. (Parity with `hf-p2r train` is not tested for growth: its own trainer's growth is being
built concurrently.)"""

import json
import re
from pathlib import Path

import pytest
import torch

from hf_p2r.integrations import Delink, Grow, P2RCallback
from hf_p2r.integrations.callback import growth_events

from ..conftest import tiny_model
from .helpers import assert_state_carried, deterministic, last_layer_dtypes, p2r_config, trainer_for

REPO = Path(__file__).resolve().parents[2]
# A shallow pseudo model (2 layers sharing 1 block, real depth 4), grown to 4 layers with 2 blocks at step 2 (stacked),
# delinked to the real model (4 blocks) at step 4; 8 steps, a checkpoint every 2: checkpoint-2 holds the 2-layer model
# (the growth is due when step 3 begins), checkpoint-4 the grown one before the delink, checkpoint-6 the real model.
SHALLOW = dict(num_hidden_layers=2, num_unique_layers=1, pseudo_steps=8, real_steps=0)
STAGE_AT = {2: (2, 1), 4: (4, 2), 6: (4, 4), 8: (4, 4)}


def grow_then_delink(**options) -> P2RCallback:
    return P2RCallback(delink_at={4: None}, growth=[Grow(2, 4, blocks=2)], **options)


def shallow_trainer(output_dir, callback, *, fields=None, **args):
    config = p2r_config(output_dir, **{**SHALLOW, **(fields or {})})
    return trainer_for(config, callback=callback, real_depth=4, **args)


def stage(trainer) -> tuple[int, int]:
    return trainer.model.config.num_hidden_layers, trainer.model.config.num_blocks


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("grown")
    trainer = shallow_trainer(output_dir, grow_then_delink(), save_strategy="steps", save_steps=2)
    trainer.train()
    return trainer, output_dir


def test_each_checkpoint_records_the_depth_and_blocks_and_holds_that_model(uninterrupted):
    trainer, output_dir = uninterrupted
    assert stage(trainer) == (4, 4) and trainer.model.config.share_layers is False
    assert trainer.model.config.real_num_hidden_layers is None  # the real depth reached
    for step, (depth, blocks) in STAGE_AT.items():
        folder = output_dir / f"checkpoint-{step}"
        state = json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"]["P2RCallback"]
        config = json.loads((folder / "config.json").read_text())
        assert state["attributes"] == {"num_hidden_layers": depth, "num_blocks": blocks}, step
        assert (config["num_hidden_layers"], config["num_unique_layers"]) == (depth, blocks), step
        assert state["args"]["growth"] == [[2, 4, 2, "stack", False]] and state["args"]["delink_at"] == [[4, None]]
    history = trainer.state.log_history
    events = [r for r in history if "p2r/grow" in r or "p2r/delink" in r]
    assert [
        (r["step"], "p2r/grow" in r, r.get("p2r/num_hidden_layers_before"), r["p2r/num_blocks_before"]) for r in events
    ] == [(2, True, 2, 1), (4, False, None, 2)]
    assert [(r["p2r/num_hidden_layers"], r["p2r/num_blocks"]) for r in events] == [(4, 2), (4, 4)]
    losses = [r for r in history if "loss" in r]
    assert [(r["p2r/num_hidden_layers"], r["p2r/num_blocks"]) for r in losses] == [(2, 1)] * 2 + [(4, 2)] * 2 + [
        (4, 4)
    ] * 4
    logged = {key: value for record in history for key, value in record.items() if key.startswith("p2r/")}
    assert all(type(value) is int for value in logged.values())  # numbers only, for every report_to integration


@pytest.mark.parametrize("checkpoint", [2, 4, 6], ids=["shallow-at-growth", "grown-at-delink", "real"])
def test_resume_from_either_side_of_a_growth_is_bitwise_the_uninterrupted_run(uninterrupted, tmp_path, checkpoint):
    trainer, output_dir = uninterrupted
    # The script builds the model it started from (2 layers, 1 block); P2RTrainer replays the schedule to the
    # checkpoint's stage.
    resumed = shallow_trainer(tmp_path, grow_then_delink())
    assert stage(resumed) == (2, 1)
    resumed.train(resume_from_checkpoint=str(output_dir / f"checkpoint-{checkpoint}"))
    assert deterministic(resumed.state.log_history) == deterministic(trainer.state.log_history)
    final, expected = resumed.model.state_dict(), trainer.model.state_dict()
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_checkpoint_of_a_stage_the_schedule_does_not_pass_is_rebuilt_by_one_delink(uninterrupted, tmp_path):
    """A checkpoint of this run resumed under another schedule (growth straight to the real model at step 6): the
    model is grown to the checkpoint's stage directly, and the run goes on from there."""
    _, output_dir = uninterrupted
    resumed = shallow_trainer(tmp_path, P2RCallback(growth={6: 4}))
    resumed.train(resume_from_checkpoint=str(output_dir / "checkpoint-4"))  # 4 layers, 2 blocks
    assert stage(resumed) == (4, 4)  # the Grow(6, 4) event: the real model (at that depth, a delink)
    after = [r["step"] for r in resumed.state.log_history if "p2r/grow" in r and r["step"] > 4]  # (before: the run's)
    assert after == [6]


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def spy_on_delink(trainer) -> dict:
    """Records the model's weights and the optimizer's state by name around each delink or growth."""
    seen, delink = [], trainer.delink

    def spied(num_unique_layers, carry):
        before = (snapshot(trainer.model), optimizer_state_by_name(trainer))
        delink(num_unique_layers, carry)
        seen.append((before, (snapshot(trainer.model), optimizer_state_by_name(trainer))))

    trainer.delink = spied
    return seen


def optimizer_state_by_name(trainer) -> dict[str, dict]:
    optimizer = trainer.optimizer.optimizer
    return {
        name: {key: value.clone() for key, value in optimizer.state[param].items()}
        for name, param in trainer.model.named_parameters()
        if param in optimizer.state
    }


def layer(name: str) -> tuple[int, str] | None:
    match = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    return (int(match[1]), match[2]) if match else None


@pytest.mark.parametrize("growth", ["stack", "interleave"])
def test_stack_and_interleave_map_every_weight_bitwise(tmp_path, growth):
    """An unshared 2-layer model grown to 4 layers at step 2: new layer i is old layer i mod 2 (stack) or i // 2
    (interleave), bit for bit; everything outside the layers unchanged."""
    callback = P2RCallback(growth=[Grow(2, 4, growth=growth)])
    trainer = shallow_trainer(tmp_path, callback, fields=dict(num_unique_layers=2, pseudo_steps=0, real_steps=3))
    seen = spy_on_delink(trainer)
    trainer.train()
    ((before, _), (after, _)), *_ = seen
    source = [i % 2 for i in range(4)] if growth == "stack" else [i // 2 for i in range(4)]
    assert len([name for name in after if layer(name)]) == 2 * len([name for name in before if layer(name)])
    for name, value in after.items():
        at = layer(name)
        old = name if at is None else f"model.layers.{source[at[0]]}.{at[1]}"
        assert torch.equal(value, before[old]), name
    assert stage(trainer) == (4, 4) and trainer.model.config.real_num_hidden_layers is None


@pytest.mark.parametrize("growth", ["stack", "interleave"])
def test_function_preserving_growth_leaves_the_loss_at_the_growth_step_unchanged(tmp_path, growth):
    """The loss logged at the first step after the growth (its forward runs the grown model with the weights the
    growth made) equals, to fp32 rounding, the loss of the same run that does not grow; the later copies' output
    projections start at zero."""
    fields = dict(num_unique_layers=2, pseudo_steps=0, real_steps=4)
    losses = {}
    for grows in (True, False):
        callback = P2RCallback(growth=[Grow(2, 4, growth=growth, function_preserving=True)]) if grows else False
        trainer = shallow_trainer(tmp_path / str(grows), callback, fields=fields)
        seen = spy_on_delink(trainer) if grows else None
        trainer.train()
        losses[grows] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        if grows:
            ((_, _), (after, _)), *_ = seen
            fresh = [1, 3] if growth == "interleave" else [2, 3]  # the later copies of each old layer
            zeroed = {name for name in after if layer(name) and re.search(r"o_proj|down_proj", name)}
            for name in zeroed:
                assert (layer(name)[0] in fresh) == (not after[name].any()), name
    # Steps 1-3: the same weights computing the same function (step 3 is the grown model's first forward).
    assert losses[True][:3] == pytest.approx(losses[False][:3], rel=1e-6, abs=0)
    assert losses[True][3] != losses[False][3]  # then the new layers learn


@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_the_carry_starts_the_grown_layers_optimizer_state(tmp_path, carry):
    """A 2-layer model sharing 1 block grown to 4 layers with 4 blocks at step 2: each new layer's Adam state is
    reset, the shared block's, or that times r = n'/n = 1/2 (r**2 for exp_avg_sq): the block ran at 2 depths, each
    copy runs at 1. Embeddings, norm and head keep theirs."""
    trainer = shallow_trainer(tmp_path, P2RCallback(growth={2: 4}, carry=carry), fields=dict(pseudo_steps=3))
    seen = spy_on_delink(trainer)
    trainer.train()
    ((_, before), (_, after)), *_ = seen
    outside = [name for name in before if not layer(name)]
    assert outside and all(torch.equal(after[n][k], before[n][k]) for n in outside for k in before[n])
    new_layers = [name for name in trainer.model.state_dict() if layer(name)]
    assert len({layer(name)[0] for name in new_layers}) == 4
    for name in new_layers:
        assert_state_carried(after, name, before[f"model.layers.0.{layer(name)[1]}"], carry, ratio=0.5)


def test_rewarm_restarts_after_a_growth_as_after_a_delink(tmp_path):
    rates = {}
    for rule in ("continue", "rewarm"):
        callback = P2RCallback(growth={2: 4}, delink_at=None, lr_after_delink=rule, rewarm_steps=2)
        trainer = shallow_trainer(tmp_path / rule, callback, fields=dict(pseudo_steps=5), lr_scheduler_type="linear")
        trainer.train()
        rates[rule] = [r["learning_rate"] for r in trainer.state.log_history if "loss" in r]
    assert rates["continue"] == pytest.approx([3e-3 * (5 - step) / 5 for step in range(5)], rel=1e-12)
    factors = [1, 1, 0.5, 1, 1]
    assert rates["rewarm"] == pytest.approx([c * f for c, f in zip(rates["continue"], factors)], rel=1e-12)


def test_bf16_autocast_covers_the_grown_model_and_the_forward_keeps_its_decorators(tmp_path):
    """Under bf16 the growth prepares the grown model again: its new layers compute under Accelerate's autocast,
    and the forward is the model's own (`restore_forward`), decorators included."""
    trainer = shallow_trainer(
        tmp_path, P2RCallback(growth={2: 4}), fields=dict(pseudo_steps=4, gradient_accumulation_steps=2), bf16=True
    )
    dtypes = last_layer_dtypes(trainer, after_step=3)  # after the growth
    trainer.train()
    assert stage(trainer) == (4, 4) and trainer.accelerator.mixed_precision == "bf16"
    assert dtypes == [torch.bfloat16] * 2  # step 4's 2 micro-batches, on the grown model's new last layer
    assert isinstance(trainer.model(input_ids=torch.randint(0, 256, (1, 8)), return_dict=False), tuple)


# --- the schedule's one-line refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("growth", "message"),
    [
        (
            {3: 4, 6: 2},
            "growth: the depth after each growth must be an integer that grows (a model never loses layers); "
            "got 2 at step 6 after 4",
        ),
        (
            [Grow(3, 4, blocks=5)],
            "growth: the blocks after the growth at step 3 must be an integer from 1 to its depth "
            "(4), or None (one per depth); got 5",
        ),
        ([Grow(3, 4, growth="repeat")], "growth: step 3: growth must be one of stack, interleave, got 'repeat'"),
        ({0: 4}, "growth: steps must be integers >= 1, increasing; got 0 after 0"),
        ([], "growth: the schedule is empty"),
        ("8", "growth: give {step: depth after it}"),
        (
            [(3, 4, 2, "stack", True, 1)],
            "growth: each event is (step, depth[, blocks[, growth[, function_preserving]]])",
        ),
    ],
)
def test_a_bad_growth_schedule_is_refused_in_one_line(growth, message):
    with pytest.raises(ValueError) as error:
        P2RCallback(growth=growth)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_schedule_forms_and_the_merged_order():
    assert growth_events({6: (8, 2), 3: 4}) == [Grow(3, 4), Grow(6, 8, 2)]
    assert growth_events([[3, 4, None, "interleave", True]]) == [Grow(3, 4, None, "interleave", True)]
    callback = P2RCallback(delink_at={9: None}, growth=Grow(3, 4, blocks=2))
    assert callback.events == [Grow(3, 4, 2), Delink(9)] and callback.delink_steps == [3, 9]
    with pytest.raises(ValueError, match=r"^growth: step 3 is also a step of delink_at"):
        P2RCallback(delink_at={3: 2}, growth={3: 4})
    with pytest.raises(ValueError, match=r"^delink_at: give the steps of the delinks"):
        P2RCallback()


def test_the_model_check_refuses_what_the_model_cannot_follow():
    shallow = tiny_model(num_hidden_layers=2, share_layers=True, num_unique_layers=1, real_num_hidden_layers=8)
    P2RCallback(growth=[Grow(3, 4, blocks=2), Grow(6, 8, blocks=4)], delink_at={9: None}).check(shallow, max_steps=10)
    cases = [
        (P2RCallback(growth={3: 16}), "growth: step 3: num_hidden_layers 16 is more than the model's real depth (8"),
        (
            P2RCallback(growth=[Grow(3, 4, blocks=2, function_preserving=True)]),
            "growth: step 3: function-preserving growth of 2 to 4 layers by 'stack' with num_unique_layers=2: block 0",
        ),
        (
            P2RCallback(growth=[Grow(3, 4, blocks=2)], delink_at={5: 3}),
            "delink_at: step 5: num_unique_layers=3 cannot be reached from 2",
        ),
        (P2RCallback(growth={3: 4}, delink_at={5: None}), "delink_at: step 5: the model has 4 layers and 4 blocks by"),
        (P2RCallback(growth={10: 4}), "growth: step 10 is at or after the run's end (max_steps 10)"),
    ]
    for callback, message in cases:
        with pytest.raises(ValueError) as error:
            callback.check(shallow, max_steps=10)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value
    full = tiny_model(num_hidden_layers=4, share_layers=True, num_unique_layers=1)  # real depth 4: no growth past it
    with pytest.raises(ValueError, match=r"^growth: step 2: num_hidden_layers 8 is more than the model's real depth"):
        P2RCallback(growth={2: 8}).check(full, max_steps=10)


def test_a_checkpoint_deeper_than_the_model_allows_is_refused(uninterrupted, tmp_path):
    _, output_dir = uninterrupted
    resumed = shallow_trainer(tmp_path, grow_then_delink())
    resumed.model.delink(num_hidden_layers=4)  # 4 layers, 4 blocks: past checkpoint-4's 2 blocks
    with pytest.raises(
        ValueError, match=r"checkpoint-4 holds a model with 4 layers and 2 blocks, this trainer's model"
    ):
        resumed.train(resume_from_checkpoint=str(output_dir / "checkpoint-4"))


def test_the_growth_snippet_of_the_docs_runs_as_written(tmp_path, monkeypatch):
    page = (REPO / "docs" / "trainer.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "growth=[Grow(" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/trainer.md", "exec"), {})
    config = json.loads((tmp_path / "runs" / "grow" / "grown" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["share_layers"], config.get("real_num_hidden_layers")) == (
        8,
        False,
        None,
    )
