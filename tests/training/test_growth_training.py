"""Depth growth in the trainer (issue 39): a shallow pseudo stage grown at its delinks, the growth schedule's
validation before torch, tokens and FLOPs in every metrics record and in the summary, exact resume across a growth,
and function-preserving growth keeping the loss."""

import json
import shutil

import pytest

from hf_p2r.config import ConfigError
from hf_p2r.models.p2r.inventory_p2r import inventory
from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.metrics import read_metrics, stage_summary, training_flops_per_token

from .helpers import TINY, TWO_DELINKS, tiny_argv, trained_run, trajectory

# L=4: 1 layer (1 block) -> grown to 2 layers (2 blocks) at step 2 -> the real model (4 layers) at step 4, 3 real steps;
# a checkpoint every step.
GROW = dict(TWO_DELINKS, pseudo_num_hidden_layers=1, num_unique_layers=1, partial_delink_depths=[2], save_steps=1)
COUNTS = ("num_hidden_layers", "tokens", "flops")


grown_run = trained_run("grown_run", **GROW)


def with_counts(output_dir) -> list[dict]:
    """`trajectory` with each record's depth, tokens and FLOPs."""
    records = read_metrics(output_dir / "metrics.jsonl")
    return [{**row, **{k: r[k] for k in COUNTS}} for row, r in zip(trajectory(output_dir), records)]


def test_the_schedule_resolves_depths_and_today_s_schedules_keep_theirs():
    config = parse_config(tiny_argv("unused", **GROW))
    assert (config.initial_depth(), config.initial_blocks()) == (1, 1)
    assert config.stage_schedule() == [(2, 2, 2), (4, 4, 4)]
    assert [config.stage_at(step) for step in range(6)] == [(1, 1), (1, 1), (2, 2), (2, 2), (4, 4), (4, 4)]
    # the constant-depth special case: every stage at L, the delink schedule as before
    demo = parse_config(["--config", "configs/demo.yaml"])
    assert demo.stage_schedule() == [(step, 8, k) for step, k in demo.delink_schedule()]
    assert demo.delink_to(8, 1, 8, 2) == 2 and demo.delink_to(8, 4, 8, 8) is None  # today's delink calls
    plan = config.delink_to(1, 1, 2, 2)
    assert (plan.before, plan.num_hidden_layers, plan.num_unique_layers, plan.sources) == ((1, 1), 2, 2, (0, 0))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(pseudo_num_hidden_layers=5), r"^pseudo_num_hidden_layers: the pseudo stage's depth is at most the real"),
        (dict(pseudo_num_hidden_layers=0), r"^pseudo_num_hidden_layers: "),
        (dict(pseudo_num_hidden_layers=2, num_unique_layers=3), r"^num_unique_layers: .* at most as many blocks as"),
        ({**GROW, "partial_delink_depths": [2, 3]}, r"^partial_delink_depths: one entry per partial_delink_"),
        (dict(pseudo_num_hidden_layers=2, partial_delink_blocks=[2], partial_delink_depths=[1]), r"^partial_delink_d"),
        (dict(pseudo_num_hidden_layers=2, partial_delink_blocks=[3], partial_delink_depths=[2]), r"^partial_delink_b"),
        (dict(growth="sideways"), r"--growth: invalid choice: 'sideways' \(choose from 'stack', 'interleave'\)"),
        (
            dict(pseudo_num_hidden_layers=1, partial_delink_blocks=[4], partial_delink_depths=[4]),
            r"^partial_delink_blocks: a partial delink keeps fewer blocks than layers \(4\), got 4",
        ),
        (
            dict(
                pseudo_num_hidden_layers=1,
                partial_delink_blocks=[1],
                partial_delink_depths=[2],
                function_preserving=True,
            ),  # fmt: skip
            r"^function_preserving: function-preserving growth of 1 to 2 layers by 'stack' with num_unique_layers=1",
        ),
        (dict(pseudo_num_hidden_layers=2, num_experts=4), r"^pseudo_num_hidden_layers: depth growth of a mixture-of"),
        (dict(pseudo_num_hidden_layers=2, pipeline_parallel_size=2), r"^pseudo_num_hidden_layers: the pipeline engine"),
    ],
)
def test_a_bad_growth_schedule_is_one_line_naming_the_field_before_torch(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(tiny_argv("unused", **{"pseudo_steps": 4, "real_steps": 2, **overrides}))
    assert "\n" not in str(caught.value)


def test_the_run_grows_records_the_depth_and_counts_tokens_and_flops(grown_run):
    records = read_metrics(grown_run / "metrics.jsonl")
    delinks = [
        (r["step"], r["num_hidden_layers_before"], r["num_hidden_layers"], r["num_blocks_before"], r["num_blocks"])
        for r in records
        if r.get("event") == "delink"
    ]
    assert delinks == [(2, 1, 2, 1, 2), (4, 2, 4, 2, 4)]
    config = parse_config(tiny_argv(grown_run, **GROW))
    tokens_per_step = TINY["per_device_batch_size"] * TINY["block_size"]
    vocab = config.model_vocab_size(len(load_tokenizer(None)))
    per_step = {
        depth: tokens_per_step * training_flops_per_token(config.model_fields(vocab, depth, depth), TINY["block_size"])
        for depth in (1, 2, 4)
    }
    steps = [r for r in records if "loss" in r]
    assert [r["num_hidden_layers"] for r in steps] == [1, 1, 2, 2, 4, 4, 4]
    assert [r["tokens"] for r in steps] == [tokens_per_step * r["step"] for r in steps]
    expected, spent = [], 0.0
    for r in steps:
        spent += per_step[{1: 1, 2: 1, 3: 2, 4: 2}.get(r["step"], 4)]
        expected.append(spent)
    assert [r["flops"] for r in steps] == pytest.approx(expected, rel=1e-12)
    assert per_step[1] < per_step[2] < per_step[4]  # a shallow step costs less
    # the same formula as the model's own inventory (the one the planner and the GPU report read)
    real_config = json.loads((grown_run / "real" / "config.json").read_text())
    assert per_step[4] == tokens_per_step * inventory(real_config).flops(TINY["block_size"])
    # the checkpoints record the depth; pseudo/ is the 2-layer model before the real delink, recording L
    state = json.loads((grown_run / "checkpoints/checkpoint-3/trainer_state.json").read_text())
    assert (state["stage"], state["state"]["num_hidden_layers"], state["state"]["num_blocks"]) == ("pseudo", 2, 2)
    pseudo = json.loads((grown_run / "pseudo" / "config.json").read_text())
    assert (pseudo["num_hidden_layers"], pseudo["real_num_hidden_layers"], pseudo["share_layers"]) == (2, 4, False)
    assert real_config["num_hidden_layers"] == 4 and real_config.get("real_num_hidden_layers") is None


def test_the_summary_gives_tokens_and_flops_per_stage(grown_run):
    pseudo, real = stage_summary(read_metrics(grown_run / "metrics.jsonl"))
    last = read_metrics(grown_run / "metrics.jsonl")[-1]
    assert (pseudo["depths"], real["depths"]) == ([1, 2], [4])
    assert pseudo["tokens"] + real["tokens"] == last["tokens"] and pseudo["tokens"] == 4 * 128
    assert pseudo["flops"] + real["flops"] == pytest.approx(last["flops"]) and 0 < pseudo["flops"] < real["flops"]
    from hf_p2r.training.run import run_summary

    text = run_summary(grown_run, read_metrics(grown_run / "metrics.jsonl"), 1.0, False)
    assert f"blocks 1 -> 2, layers 1 -> 2, {pseudo['tokens']:,} tokens, {pseudo['flops']:.3g} FLOPs" in text
    assert f"blocks 4, {real['tokens']:,} tokens, {real['flops']:.3g} FLOPs" in text


@pytest.mark.parametrize("resume_step", [1, 2, 3, 4, 5])  # shallow, at the partial growth, grown, at the real one, real
def test_resume_across_a_growth_continues_exactly(grown_run, tmp_path, resume_step):
    output_dir = tmp_path / "run"
    shutil.copytree(grown_run, output_dir)
    checkpoint = output_dir / "checkpoints" / f"checkpoint-{resume_step}"
    assert train(parse_config(tiny_argv(output_dir, **GROW, resume_from_checkpoint=checkpoint))) == 0
    assert with_counts(output_dir) == with_counts(grown_run)  # every loss, rate, norm, depth, count: bitwise
    assert [p.name for p in list_checkpoints(output_dir)] == [p.name for p in list_checkpoints(grown_run)]


def test_resume_refuses_a_checkpoint_of_another_depth(grown_run, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(grown_run, output_dir)
    other = {**GROW, "partial_delink_depths": [3]}
    argv = tiny_argv(output_dir, **other, resume_from_checkpoint=output_dir / "checkpoints" / "checkpoint-3")
    with pytest.raises(ValueError, match=r"holds a model of 2 layers and 2 blocks at step 3, but this configuration h"):
        train(parse_config(argv))


@pytest.mark.parametrize(("depth_mup", "preserving"), [(False, True), (True, True), (False, False)])
def test_function_preserving_growth_keeps_the_loss_at_the_growth_step(tmp_path, depth_mup, preserving):
    """The step after a growth at step 3 runs the grown model on the batch a run growing one step later runs the
    shallow model on, with the same weights: the same loss (to fp32 rounding under depth-muP, whose kept outputs are
    rescaled; bitwise without), unless the new layers start as plain copies."""
    common = dict(pseudo_num_hidden_layers=2, num_unique_layers=2, function_preserving=preserving, depth_mup=depth_mup)
    common.update(eval_steps=0, optimizer_carry="reset", save_steps=0)
    grown = tmp_path / "grown"
    later = tmp_path / "later"
    assert train(parse_config(tiny_argv(grown, **common, pseudo_steps=3, real_steps=2))) == 0
    assert train(parse_config(tiny_argv(later, **common, pseudo_steps=4, real_steps=1))) == 0
    a = {r["step"]: r for r in trajectory(grown) if "loss" in r}
    b = {r["step"]: r for r in trajectory(later) if "loss" in r}
    assert [a[s]["loss"] for s in (1, 2, 3)] == [b[s]["loss"] for s in (1, 2, 3)]  # the same shallow steps
    if not preserving:
        assert a[4]["loss"] != pytest.approx(b[4]["loss"], rel=1e-4)  # the comparison can fail
    elif depth_mup:
        assert a[4]["loss"] == pytest.approx(b[4]["loss"], rel=1e-6)
    else:
        assert a[4]["loss"] == b[4]["loss"]
