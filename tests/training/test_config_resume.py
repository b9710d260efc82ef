"""A resume takes the run's saved configuration (issue 37, items 4 and 5): the flags typed change it and the run says
which in one line; the config file given again changes nothing (said); the fields a checkpoint's weights depend on
are refused in the checkpoint's own words, before torch; a longer run keeps its learning-rate schedule's end unless
asked; the summary's training time is this invocation's."""

import json
import re

import pytest

from hf_p2r.config import ConfigError, parse_config
from hf_p2r.training import train
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.optim import learning_rate_at

from .helpers import tiny_argv

RUN = dict(pseudo_steps=2, real_steps=2, save_steps=1, learning_rate=2e-3, warmup_steps=1, eval_steps=0)


def _checkpoint(output_dir, argv: list[str], step: int = 4):
    """A checkpoint folder holding only the trainer_state.json a run of `argv` writes at `step` (what the parser
    reads)."""
    folder = output_dir / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    state = {"step": step, "num_blocks": 4, "blocks_consumed": 0, "train_time_s": 1.0, "log_loss_sum": 0.0,
             "log_steps": 0, "metrics_records": 1}  # fmt: skip
    payload = {"stage": "real", "state": state, "config": parse_config(argv).to_dict()}
    (folder / "trainer_state.json").write_text(json.dumps(payload))
    return folder


def test_a_resume_takes_the_saved_configuration_and_says_what_the_flags_change(tmp_path):
    output_dir = tmp_path / "run"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"output_dir: {output_dir}\nlearning_rate: 1.0e-3\nhidden_size: 64\n")
    # The run: the YAML, with overrides typed on the command line.
    argv = ["--config", str(yaml_file), *tiny_argv(output_dir, **RUN)]
    checkpoint = _checkpoint(output_dir, argv)
    # The resume: the YAML and --resume_from_checkpoint only, then one flag.
    resumed = parse_config(
        ["--config", str(yaml_file), "--resume_from_checkpoint", "latest", "--optimizer_carry", "copy"]
    )
    assert resumed.to_dict() == {
        **parse_config(argv).to_dict(),
        "resume_from_checkpoint": "latest",
        "optimizer_carry": "copy",
    }
    assert (
        resumed.notes[0]
        == f"resume: the configuration saved in {checkpoint}, with optimizer_carry 'scale' -> 'copy' (given now)"
    )
    # The YAML's learning_rate (typed over on the first run's command line) is the saved one's, and said.
    assert resumed.train.learning_rate == 2e-3
    assert resumed.notes[1] == (
        "resume: the config file's learning_rate, hidden_size not applied (the saved run's are kept; a flag changes "
        "one)"
    )


def test_a_flag_changing_what_the_weights_depend_on_is_refused_before_torch(tmp_path):
    output_dir = tmp_path / "run"
    checkpoint = _checkpoint(output_dir, tiny_argv(output_dir, **RUN))
    with pytest.raises(ConfigError) as raised:
        parse_config(["--output_dir", str(output_dir), "--resume_from_checkpoint", "latest", "--hidden_size", "64"])
    assert str(raised.value) == (
        f"resume_from_checkpoint: {checkpoint} comes from a different run (hidden_size=32 there, 64 now)"
    )


def test_extending_the_run_keeps_the_schedules_end_unless_asked(tmp_path):
    output_dir = tmp_path / "run"
    _checkpoint(output_dir, tiny_argv(output_dir, **RUN))
    base = ["--output_dir", str(output_dir), "--resume_from_checkpoint", "latest"]
    longer = parse_config([*base, "--real_steps", "6"])
    assert longer.train.lr_schedule_steps == 4 and longer.train.total_steps == 8
    assert longer.notes[-1] == (
        "resume: the learning-rate schedule keeps its end at step 4 (lr_schedule_steps 4; steps 4-7 at its final "
        "rate); --lr_schedule_steps 8 fits it to the new length instead"
    )
    original = parse_config(tiny_argv(output_dir, **RUN)).train
    rates = [learning_rate_at(step, longer.train, [2]) for step in range(8)]
    assert rates[:4] == [learning_rate_at(step, original, [2]) for step in range(4)]  # unchanged up to its end
    assert rates[4:] == [rates[3]] * 4 == [pytest.approx(2e-3 * 0.1)] * 4  # then its final rate
    stretched = parse_config([*base, "--real_steps", "6", "--lr_schedule_steps", "8"])
    assert stretched.train.schedule_steps == 8 and not any("keeps its end" in note for note in stretched.notes)
    same = parse_config(base)
    assert same.train.lr_schedule_steps is None and len(same.notes) == 1


def test_an_interrupted_run_resumed_with_its_checkpoint_alone_continues_and_says_its_time(tmp_path, capsys):
    """End to end: a run of 4 steps with flags, resumed with --resume_from_checkpoint latest and --real_steps 4 only:
    the same configuration (no flag typed again), the learning rate of the old end held, the summary's training time
    this invocation's."""
    output_dir = tmp_path / "run"
    assert train(parse_config(tiny_argv(output_dir, **RUN))) == 0
    capsys.readouterr()
    assert train(parse_config(["--output_dir", str(output_dir), "--resume_from_checkpoint", "latest",
                               "--real_steps", "4"])) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "resume: the configuration saved in" in printed and "real_steps 2 -> 4" in printed
    lrs = {r["step"]: r["lr"] for r in read_metrics(output_dir / "metrics.jsonl") if "lr" in r}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6] and lrs[5] == lrs[6] == lrs[4]
    summary = printed[printed.index("***** run summary") :].splitlines()
    line = next(line for line in summary if line.startswith("  wall time"))
    assert re.fullmatch(
        r"  wall time: [\d.]+ s \(resumed at step 4\), of which training steps [\d.]+ s; training steps of the whole "
        r"run [\d.]+ s",
        line,
    )
