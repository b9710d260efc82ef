"""P2RTrainer + P2RCallback in one CPU process on a tiny model (a few seconds a run): the carries, resume from either
side of a delink bitwise, the stage in checkpoints and logs (TensorBoard), evaluation on the current model, gradient
accumulation with bf16 autocast, a push of the real model with hf-p2r's card (a mocked Hub), and the refusals."""

import json
import shutil
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer

from hf_p2r.integrations import P2RCallback, P2RTrainerMixin

from .helpers import assert_state_carried, deterministic, last_layer_dtypes, p2r_config, trainer_for

# 1 block -> 2 at step 2 -> the real model (4 layers) at step 4, 8 steps; a checkpoint every 2 steps: checkpoint-2 and
# checkpoint-4 hold the model before the delink due at their step, checkpoint-6 the real model.
SCHEDULE = dict(pseudo_steps=4, real_steps=4, partial_delink_blocks=[2], partial_delink_steps=[2])
BLOCKS_AT = {2: 1, 4: 2, 6: 4, 8: 4}


def blocks_of_depths(trainer) -> int:
    return trainer.model.config.num_blocks


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The whole run, saving every 2 steps; its trainer (history, final weights) and its output folder."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    trainer = trainer_for(p2r_config(output_dir, **SCHEDULE), save_strategy="steps", save_steps=2)
    trainer.train()
    return trainer, output_dir


def test_each_checkpoint_says_its_stage_and_holds_that_model(uninterrupted):
    trainer, output_dir = uninterrupted
    assert blocks_of_depths(trainer) == 4 and trainer.model.config.share_layers is False
    for step, blocks in BLOCKS_AT.items():
        folder = output_dir / f"checkpoint-{step}"
        state = json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"]["P2RCallback"]
        config = json.loads((folder / "config.json").read_text())
        assert state["attributes"]["num_blocks"] == blocks, step
        assert config["num_unique_layers"] == blocks and config["share_layers"] is (blocks < 4), step
        assert state["args"]["delink_at"] == [[2, 2], [4, None]]
    delinks = [r for r in trainer.state.log_history if "p2r/delink" in r]
    assert [(r["step"], r["p2r/num_blocks_before"], r["p2r/num_blocks"]) for r in delinks] == [(2, 1, 2), (4, 2, 4)]
    losses = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["p2r/num_blocks"] for r in losses] == [1, 1, 2, 2, 4, 4, 4, 4]  # each record's stage, as it trained


@pytest.mark.parametrize("checkpoint", [2, 4, 6], ids=["pseudo-at-partial-delink", "pseudo-at-delink", "real"])
def test_resume_from_either_side_of_a_delink_is_bitwise_the_uninterrupted_run(uninterrupted, tmp_path, checkpoint):
    trainer, output_dir = uninterrupted
    # The script builds the model it starts from (1 block); P2RTrainer delinks it to the checkpoint's stage.
    resumed = trainer_for(p2r_config(tmp_path, **SCHEDULE))
    assert blocks_of_depths(resumed) == 1
    resumed.train(resume_from_checkpoint=str(output_dir / f"checkpoint-{checkpoint}"))
    assert deterministic(resumed.state.log_history) == deterministic(trainer.state.log_history)
    final, expected = resumed.model.state_dict(), trainer.model.state_dict()
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)


def test_resume_latest_finds_the_newest_checkpoint(uninterrupted, tmp_path):
    trainer, output_dir = uninterrupted
    shutil.copytree(output_dir / "checkpoint-6", tmp_path / "checkpoint-6")
    resumed = trainer_for(p2r_config(tmp_path, **SCHEDULE))
    resumed.train(resume_from_checkpoint=True)
    assert deterministic(resumed.state.log_history) == deterministic(trainer.state.log_history)


def test_a_model_past_the_checkpoints_stage_is_refused(uninterrupted, tmp_path):
    _, output_dir = uninterrupted
    resumed = trainer_for(p2r_config(tmp_path, **SCHEDULE))
    resumed.model.delink()
    with pytest.raises(
        ValueError,
        match=r"checkpoint-2 holds a model with 4 layers and 1 blocks, this trainer.s model has 4 layers and 4 b",
    ):
        resumed.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))


def optimizer_state_by_name(trainer) -> dict[str, dict]:
    state = trainer.optimizer.optimizer.state
    return {
        name: {key: value.clone() for key, value in state[param].items()}
        for name, param in trainer.model.named_parameters()
        if param in state
    }


@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_the_carry_starts_the_new_blocks_optimizer_state(tmp_path, carry):
    """The full delink of a 1-block model to 4 layers after 2 steps: each new block's Adam state is reset, the shared
    block's, or that times r = 1/4 (r**2 for exp_avg_sq); the embeddings, norm and head keep theirs. The optimizer
    is the one Trainer builds (fused AdamW, decay and no-decay groups)."""
    trainer = trainer_for(p2r_config(tmp_path, pseudo_steps=2, real_steps=1, optimizer_carry=carry))
    seen, delink = {}, trainer.delink

    def spied(num_unique_layers, carry_given):
        seen["before"] = optimizer_state_by_name(trainer)
        delink(num_unique_layers, carry_given)
        seen["after"] = optimizer_state_by_name(trainer)

    trainer.delink = spied
    trainer.train()
    before, after = seen["before"], seen["after"]
    outside = [name for name in before if ".layers." not in name]
    assert outside and all(torch.equal(after[n][k], before[n][k]) for n in outside for k in before[n])
    new_blocks = [name for name in trainer.model.state_dict() if ".layers." in name]
    assert len(new_blocks) == 4 * len([name for name in before if ".layers." in name])
    for name in new_blocks:
        source = before[name.replace(name.split(".")[2], "0", 1)]  # model.layers.<j>.… ran block 0
        assert_state_carried(after, name, source, carry, ratio=0.25)
    groups = trainer.optimizer.optimizer.param_groups
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW and groups[0]["fused"]
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    assert sum(len(group["params"]) for group in groups) == len(list(trainer.model.parameters()))


def test_rewarm_scales_the_schedule_after_each_delink_and_continue_keeps_it(tmp_path):
    fields = dict(SCHEDULE, lr_scheduler="linear", warmup_steps=0, rewarm_steps=2)
    rates = {}
    for rule in ("continue", "rewarm"):
        trainer = trainer_for(p2r_config(tmp_path / rule, lr_after_delink=rule, **fields))
        trainer.train()
        rates[rule] = [r["learning_rate"] for r in trainer.state.log_history if "loss" in r]
    # transformers' linear schedule from 3e-3 to 0 over 8 steps, each step's rate times (since + 1) / 2 after the
    # delinks at 2 and 4
    assert rates["continue"] == pytest.approx([3e-3 * (8 - step) / 8 for step in range(8)], rel=1e-12)
    factors = [1, 1, 0.5, 1, 0.5, 1, 1, 1]
    assert rates["rewarm"] == pytest.approx([c * f for c, f in zip(rates["continue"], factors)], rel=1e-12)


def test_tensorboard_sees_the_stage_and_the_delinks(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = trainer_for(p2r_config(tmp_path, **SCHEDULE), report_to=["tensorboard"])
    trainer.train()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))  # output_dir/runs/...
    events.Reload()
    stage = {}
    for event in events.Scalars("train/p2r/num_blocks"):
        stage.setdefault(event.step, set()).add(event.value)
    # Each step's records: its loss's (the blocks it trained with) and, at 2 and 4, the delink's (the blocks after).
    assert stage == {1: {1}, 2: {1, 2}, 3: {2}, 4: {2, 4}, 5: {4}, 6: {4}, 7: {4}, 8: {4}}
    assert [(e.step, e.value) for e in events.Scalars("train/p2r/delink")] == [(2, 1), (4, 1)]


def test_evaluation_runs_on_the_current_model(tmp_path):
    trainer = trainer_for(p2r_config(tmp_path, **SCHEDULE), eval_strategy="steps", eval_steps=3)
    trainer.train()
    evaluations = {r["step"]: r for r in trainer.state.log_history if "eval_loss" in r}
    assert sorted(evaluations) == [3, 6, 8] and evaluations[3]["p2r/num_blocks"] == 2
    # The last evaluation is the delinked (real) model's loss on the validation blocks, computed here again.
    model = trainer.model.eval()
    with torch.no_grad():
        ids = torch.stack([row["input_ids"] for row in trainer.eval_dataset])
        losses = [model(input_ids=ids[i : i + 4], labels=ids[i : i + 4]).loss for i in range(0, len(ids), 4)]
    assert evaluations[8]["p2r/num_blocks"] == 4 and model.config.share_layers is False
    assert evaluations[8]["eval_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)


def test_gradient_accumulation_and_bf16_autocast_go_on_after_the_delink(tmp_path):
    config = p2r_config(tmp_path, gradient_accumulation_steps=2, per_device_batch_size=2, **SCHEDULE)
    trainer = trainer_for(config, bf16=True)
    dtypes = last_layer_dtypes(trainer, after_step=6)  # after the delink
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 8 and all(0 < loss < 10 for loss in losses) and blocks_of_depths(trainer) == 4
    assert dtypes == [torch.bfloat16] * 4  # 2 steps x 2 micro-batches, under Accelerate's autocast again
    assert trainer.accelerator.mixed_precision == "bf16"
    # The forward is the model's own, decorators included (Accelerate's unwrap would have kept its innermost function)
    ids = torch.randint(0, 256, (1, 8))
    assert isinstance(trainer.model(input_ids=ids, return_dict=False), tuple)


def test_push_to_hub_publishes_the_real_model_with_hf_p2rs_card(tmp_path):
    """`push_to_hub` after the run: the folder transformers' Trainer uploads (its `hf_api`, mocked: no network)
    holds the real model, loadable, and hf-p2r's model card."""
    snapshot = tmp_path / "uploaded"
    api = mock.MagicMock()
    api.create_repo.return_value = SimpleNamespace(repo_id="me/p2r-tiny")
    api.upload_folder.side_effect = lambda folder_path, **kwargs: shutil.copytree(
        folder_path, snapshot, ignore=shutil.ignore_patterns("checkpoint-*")
    )
    with mock.patch("transformers.trainer.hf_api", return_value=api):
        trainer = trainer_for(
            p2r_config(tmp_path / "run", **SCHEDULE), push_to_hub=True, hub_model_id="me/p2r-tiny", hub_strategy="end"
        )
        trainer.train()
        trainer.push_to_hub(tags="demo")
    assert api.upload_folder.call_args.kwargs["repo_id"] == "me/p2r-tiny"
    config = json.loads((snapshot / "config.json").read_text())
    assert config["share_layers"] is False and config["num_unique_layers"] == 4
    card = (snapshot / "README.md").read_text()
    assert "A *real* P2R model" in card and "pseudo-to-real" in card and "- demo" in card and "me/p2r-tiny" in card
    loaded = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).state_dict()
    trained = trainer.model.state_dict()
    assert all(torch.equal(loaded[name], trained[name]) for name in trained)


def test_the_loops_private_hooks_are_still_called_with_its_model(tmp_path):
    """P2RTrainer overrides two private methods of Trainer's loop (it passes them the model it prepared at the start):
    a transformers release that stops calling them would leave FSDP2's clipping on the old model, silently."""
    trainer = trainer_for(p2r_config(tmp_path, pseudo_steps=1, real_steps=2))
    calls = {"_clip_grad_norm": [], "_get_grad_norm": []}

    def spy(name):
        def called(model, *args, **kwargs):
            calls[name].append(model)
            return getattr(P2RTrainerMixin, name)(trainer, model, *args, **kwargs)

        return called

    for name in calls:
        setattr(trainer, name, spy(name))
    trainer.train()
    loops_model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    assert [len(seen) for seen in calls.values()] == [3, 3] and all(m is loops_model for m in calls["_clip_grad_norm"])


def test_a_plain_trainer_with_the_callback_is_refused_in_one_line(tmp_path):
    trainer = trainer_for(p2r_config(tmp_path, **SCHEDULE), trainer_class=Trainer)
    with pytest.raises(ValueError, match=r"^P2RCallback: transformers' Trainer cannot swap its model .*P2RTrainer"):
        trainer.train()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
            "load_best_model_at_end",
        ),
        ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"}, "rewarm multiplies a LambdaLR"),
        ({"torch_compile": True}, "torch_compile: not supported"),
    ],
)
def test_what_cannot_run_is_refused_before_training(tmp_path, args, message):
    trainer = trainer_for(p2r_config(tmp_path, lr_after_delink="rewarm", **SCHEDULE), **args)
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_an_optimizer_instance_is_refused(tmp_path):
    trainer = trainer_for(p2r_config(tmp_path, **SCHEDULE))
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    refused = type(trainer)(
        model=trainer.model,
        args=trainer.args,
        train_dataset=trainer.train_dataset,
        data_collator=trainer.data_collator,
        callbacks=[P2RCallback(2)],
        optimizers=(optimizer, None),
    )
    with pytest.raises(ValueError, match=r"^optimizers: an optimizer instance cannot be rebuilt"):
        refused.train()


def test_a_model_that_is_not_p2r_is_refused(tmp_path):
    trainer = trainer_for(p2r_config(tmp_path, **SCHEDULE))
    llama = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    refused = type(trainer)(
        model=LlamaForCausalLM(llama),
        args=trainer.args,
        train_dataset=trainer.train_dataset,
        data_collator=trainer.data_collator,
        callbacks=[P2RCallback(2)],
    )
    with pytest.raises(ValueError, match=r"^model: P2RCallback delinks a P2R model .* got LlamaForCausalLM"):
        refused.train()
