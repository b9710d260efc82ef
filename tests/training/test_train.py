"""The training run in-process: outputs, exact resume before / at / after the delink, non-finite loss, weights or
optimizer state, trackers, the summary at the end."""

import json
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_p2r import P2RForCausalLM, cli
from hf_p2r.training import NonFiniteLossError, parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.engines.accelerate import check_gpu_per_process
from hf_p2r.training.metrics import delink_points, read_metrics

from .helpers import PYTHON, REPO, TWO_DELINKS, subprocess_env, tiny_argv, trained_run, trajectory

SCHEDULE = dict(TWO_DELINKS, save_steps=1)  # a checkpoint every step


full_run = trained_run("full_run", **SCHEDULE)  # one uninterrupted run, shared by the tests below


def test_run_writes_both_models_metrics_and_checkpoints(full_run):
    records = json.loads("[" + ",".join((full_run / "metrics.jsonl").read_text().splitlines()) + "]")
    delinks = [(r["step"], r["num_blocks_before"], r["num_blocks"]) for r in records if r.get("event") == "delink"]
    assert delinks == [(2, 1, 2), (4, 2, 4)]
    assert delink_points(read_metrics(full_run / "metrics.jsonl")) == [(2, 2), (4, 4)]  # what loss.png marks
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 8))
    assert {r["stage"] for r in records if "loss" in r and r["step"] <= 4} == {"pseudo"}
    assert {r["stage"] for r in records if "loss" in r and r["step"] > 4} == {"real"}
    assert all(r["tokens_per_s"] > 0 and r["memory_gb"] > 0 for r in records if "loss" in r)
    assert (full_run / "loss.png").stat().st_size > 0
    assert [p.name for p in list_checkpoints(full_run)] == [f"checkpoint-{step}" for step in range(1, 8)]

    # pseudo/ is the model just before the last delink (2 shared blocks), real/ the final model; both with tokenizer.
    pseudo = AutoModelForCausalLM.from_pretrained(full_run / "pseudo")
    real = AutoModelForCausalLM.from_pretrained(full_run / "real")
    assert (pseudo.config.share_layers, pseudo.config.num_unique_layers) == (True, 2)
    assert (real.config.share_layers, len(real.model.layers)) == (False, 4)
    for folder in ("pseudo", "real"):
        assert AutoTokenizer.from_pretrained(full_run / folder)("ab")["input_ids"] == [97, 98]
    # pseudo/ delinks on load into exactly the model the real stage started from.
    started = P2RForCausalLM.from_pretrained(full_run / "pseudo", share_layers=False).eval()
    ids = torch.arange(3, 35).unsqueeze(0)
    assert torch.equal(started(ids).logits, pseudo.eval()(ids).logits)


def test_checkpoints_record_their_stage(full_run):
    def stage(step: int) -> str:
        return json.loads((full_run / f"checkpoints/checkpoint-{step}/trainer_state.json").read_text())["stage"]

    # checkpoint-4 is saved before the delink to the real model at step 4
    assert {step: stage(step) for step in (1, 4, 5, 7)} == {1: "pseudo", 4: "pseudo", 5: "real", 7: "real"}


@pytest.mark.parametrize("resume_step", [1, 2, 4, 5])  # pseudo (k=1), at the partial delink, at the real delink, real
def test_resume_continues_exactly(full_run, tmp_path, resume_step):
    output_dir = tmp_path / "run"
    shutil.copytree(full_run, output_dir)
    checkpoint = output_dir / "checkpoints" / f"checkpoint-{resume_step}"
    assert train(parse_config(tiny_argv(output_dir, **SCHEDULE, resume_from_checkpoint=checkpoint))) == 0
    assert trajectory(output_dir) == trajectory(full_run)  # every loss, learning rate and gradient norm, bitwise
    assert [p.name for p in list_checkpoints(output_dir)] == [p.name for p in list_checkpoints(full_run)]


def test_resume_into_a_new_output_dir_continues_exactly_and_leaves_the_source_run_alone(full_run, tmp_path):
    """Another run's checkpoint resumed into a folder that does not exist yet (found by the GPU report's FSDP2 part:
    the metrics file's temporary copy was written into the missing folder): the new folder holds what came after the
    checkpoint, equal to the uninterrupted run's, and the source run is not touched."""
    source = tmp_path / "source"
    shutil.copytree(full_run, source)
    before = {path: path.read_bytes() for path in sorted(source.rglob("*")) if path.is_file()}
    output_dir = tmp_path / "new" / "run"
    checkpoint = source / "checkpoints" / "checkpoint-5"
    assert train(parse_config(tiny_argv(output_dir, **SCHEDULE, resume_from_checkpoint=checkpoint))) == 0
    assert trajectory(output_dir) == [r for r in trajectory(full_run) if r["step"] > 5]
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-6", "checkpoint-7"]
    assert (output_dir / "real" / "config.json").is_file()
    assert {path: path.read_bytes() for path in sorted(source.rglob("*")) if path.is_file()} == before


def test_resume_comparison_can_fail(full_run, tmp_path):
    """Control: resuming with another optimizer carry changes the losses after the delink, and the test sees it."""
    output_dir = tmp_path / "run"
    shutil.copytree(full_run, output_dir)
    argv = tiny_argv(output_dir, **SCHEDULE, resume_from_checkpoint="latest", optimizer_carry="reset")
    shutil.rmtree(output_dir / "checkpoints" / "checkpoint-7")
    for step in (6, 5, 4, 3):
        shutil.rmtree(output_dir / "checkpoints" / f"checkpoint-{step}")  # "latest" is now checkpoint-2
    assert train(parse_config(argv)) == 0
    resumed, full = trajectory(output_dir), trajectory(full_run)
    assert resumed[:4] == full[:4]
    assert [r.get("loss") for r in resumed if r["step"] > 3] != [r.get("loss") for r in full if r["step"] > 3]


def test_resume_refuses_a_checkpoint_of_another_model(full_run, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(full_run, output_dir)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* different run \(hidden_size=32 there, 64 now\)"):
        train(parse_config(tiny_argv(output_dir, **SCHEDULE, resume_from_checkpoint="latest", hidden_size=64)))


def test_fresh_run_refuses_an_earlier_run_without_overwrite(full_run):
    with pytest.raises(FileExistsError, match="output_dir: .* already holds a run"):
        train(parse_config(tiny_argv(full_run, **SCHEDULE)))


def test_non_finite_loss_stops_without_touching_the_last_checkpoint(tmp_path, monkeypatch):
    calls = {"n": 0}
    forward = P2RForCausalLM.forward

    def poisoned(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:  # the third training step
                output.loss = output.loss * float("nan")
        return output

    monkeypatch.setattr(P2RForCausalLM, "forward", poisoned)
    output_dir = tmp_path / "run"
    with pytest.raises(
        NonFiniteLossError,
        match=r"non-finite training loss \(nan\) at step 3 \(pseudo stage\).*"
        r"checkpoint-2",
    ):
        train(parse_config(tiny_argv(output_dir, **SCHEDULE)))
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((output_dir / "checkpoints/checkpoint-2/trainer_state.json").read_text())["state"]["step"] == 2
    assert not (output_dir / "real").exists()


def _poison_the_update(monkeypatch, at_step: int, where: str) -> None:
    """From optimizer step `at_step` on, the update leaves a NaN in the weights or an infinity in AdamW's state; the
    loss of that step, computed before the update, is finite."""
    calls = {"n": 0}
    step = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= at_step:
            param = self.param_groups[0]["params"][0]
            with torch.no_grad():
                if where == "weights":
                    param[0] = float("nan")
                else:
                    self.state[param]["exp_avg_sq"].fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)


@pytest.mark.parametrize("where", ["weights", "optimizer state"])
@pytest.mark.parametrize("save_total_limit", [100, 1])
def test_a_checkpoint_with_non_finite_weights_or_state_is_never_written(tmp_path, monkeypatch, where, save_total_limit):
    """The loss of step 3 is finite, its update is not: checkpoint-3 is not written (so save_total_limit cannot prune
    checkpoint-2 for it), and the error names checkpoint-2, whose weights and state are finite."""
    _poison_the_update(monkeypatch, 3, where)
    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, **SCHEDULE, save_total_limit=save_total_limit)
    message = (
        r"^non-finite weights or optimizer state after step 3 \(pseudo stage\): stopped without saving the "
        r"checkpoint; last good checkpoint: .*checkpoint-2;"
    )
    with pytest.raises(NonFiniteLossError, match=message):
        train(parse_config(argv))
    kept = [p.name for p in list_checkpoints(output_dir)]
    assert kept == (["checkpoint-1", "checkpoint-2"] if save_total_limit == 100 else ["checkpoint-2"])
    last = output_dir / "checkpoints/checkpoint-2"
    tensors = [*load_file(last / "model.safetensors").values()]
    state = torch.load(last / "optimizer.bin", weights_only=True)["state"]
    tensors += [tensor for values in state.values() for tensor in values.values()]
    assert len(tensors) > 10 and all(torch.isfinite(tensor).all() for tensor in tensors)


def test_pseudo_is_not_saved_with_non_finite_weights(tmp_path, monkeypatch):
    """No checkpoint at step 4 (save_steps 3): the check before pseudo/ is written (at the delink after step 4)."""
    _poison_the_update(monkeypatch, 4, "weights")
    output_dir = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"after step 4 \(pseudo stage\): stopped without saving the pseudo/"):
        train(parse_config(tiny_argv(output_dir, **{**SCHEDULE, "save_steps": 3})))
    assert not (output_dir / "pseudo").exists()
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-3"]


@pytest.mark.parametrize("remote_code", [True, False])
def test_the_run_ends_with_a_summary_whose_paths_exist_and_whose_commands_work(
    tmp_path, capsys, monkeypatch, remote_code
):
    output_dir = tmp_path / "run"
    assert train(parse_config(tiny_argv(output_dir, pseudo_steps=2, real_steps=2, remote_code=remote_code))) == 0
    printed = capsys.readouterr().out
    summary = printed[printed.index("***** run summary") :].splitlines()
    assert summary[0] == f"***** run summary: {output_dir} *****"

    # Each stage's figures, from metrics.jsonl.
    records = read_metrics(output_dir / "metrics.jsonl")
    val = {
        stage: [r["val_loss"] for r in records if r["stage"] == stage and "val_loss" in r][-1]
        for stage in ("pseudo", "real")
    }
    # tokens and FLOPs spent in each stage (2 steps of 4 x 32 tokens each), from the records' cumulative counts
    flops = {stage: max(r["flops"] for r in records if r["stage"] == stage) for stage in ("pseudo", "real")}
    spent = {"pseudo": re.escape(f"{flops['pseudo']:.3g}"), "real": re.escape(f"{flops['real'] - flops['pseudo']:.3g}")}
    assert re.fullmatch(
        rf"  pseudo stage: steps 0-2, blocks 1, 256 tokens, {spent['pseudo']} FLOPs, val_loss {val['pseudo']:.4f}, "
        r"[\d,]+ tokens/s",
        summary[1],
    )
    assert re.fullmatch(
        rf"  real stage:   steps 2-4, blocks 4, 256 tokens, {spent['real']} FLOPs, val_loss {val['real']:.4f}, "
        r"[\d,]+ tokens/s",
        summary[2],
    )
    assert re.fullmatch(r"  wall time: [\d.]+ s, of which training steps [\d.]+ s", summary[3])

    # Every output it names exists.
    start, end = summary.index("  outputs:"), summary.index("  next:")
    named = [line.split()[0] for line in summary[start + 1 : end]]
    assert [Path(name).name for name in named] == ["real", "pseudo", "metrics.jsonl", "loss.png", "checkpoints"]
    assert all(Path(name).exists() for name in named)

    # The next commands work as printed: load the real model, push it (a dry run), delink pseudo/.
    commands = {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in summary[end + 1 :]}
    assert set(commands) == {"load it (Python)", "publish it on the Hub", "delink pseudo/"}
    # In a fresh Python: with remote_code the folder's own code, without it `import hf_p2r`, as the line says.
    load = commands["load it (Python)"] + "; print(len(model.model.layers), model.config.share_layers)"
    assert ("trust_remote_code=True" in load) is remote_code and ("import hf_p2r" in load) is not remote_code
    loaded = subprocess.run([PYTHON, "-c", load], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert loaded.stdout.split()[-2:] == ["4", "False"], loaded.stderr[-3000:]  # (after the generated text)
    push = shlex.split(commands["publish it on the Hub"])
    assert Path(push[0]).name == "hf-p2r" and push[1:] == ["push", str(output_dir / "real"), "USER/NAME"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main([*push[1:], "--dry-run"]) == 0
    convert = shlex.split(commands["delink pseudo/"].split("  (")[0])
    assert cli.main(convert[1:]) == 0
    delinked = AutoModelForCausalLM.from_pretrained(convert[-1])
    assert (delinked.config.share_layers, len(delinked.model.layers)) == (False, 4)


def test_report_to_tensorboard_writes_events_under_logs(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, pseudo_steps=2, real_steps=1, eval_steps=2, report_to="tensorboard")
    assert train(parse_config(argv)) == 0
    # Accelerate's TensorBoard tracker writes the scalars into logs/ (and the run's configuration, as hyperparameters,
    # into a subfolder of it).
    events = EventAccumulator(str(output_dir / "logs")).Reload()
    assert {"loss", "lr", "val_loss", "num_blocks_before"} <= set(events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("loss")] == [1, 2, 3]
    assert [event.step for event in events.Scalars("val_loss")] == [0, 2, 3]


def test_repeated_sigterm_is_one_stop_request_and_a_second_ctrl_c_stops_at_once():
    """In a subprocess (a signal that the handler let through would end the process), signalled from here as a
    launcher or a user would. Each signal is sent once the child has said it is ready for it: two pending signals of
    one kind would merge into one, and a loaded machine delays a child's start and its handlers by seconds."""
    code = """
import signal, sys, time
from hf_p2r.training.run import StopOnSignal

# As in a terminal: a shell starting this suite in the background (`cmd &`) hands its children SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

class Counting(StopOnSignal):
    handled = 0

    def _handle(self, signum, frame):
        super()._handle(signum, frame)
        self.handled += 1

with Counting() as stop:
    print("ready", flush=True)
    try:
        for expected in (1, 2, 3):
            while stop.handled < expected:
                time.sleep(0.01)
            print("handled", expected, flush=True)
        print(stop.signum, flush=True)  # the first signal's
        while True:  # until the second Ctrl-C
            time.sleep(0.01)
    except KeyboardInterrupt:
        print("second Ctrl-C: KeyboardInterrupt", flush=True)
"""
    child = subprocess.Popen(
        [PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO
    )

    def stopped(process: subprocess.Popen) -> str:
        process.kill()
        return process.stderr.read()

    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in child.stdout] + [lines.put("")], daemon=True).start()
    try:
        # A SIGTERM, again (to the launcher's group, then as the launcher's death signal), a Ctrl-C, a second one.
        for line, signum in [
            ("ready", signal.SIGTERM),
            ("handled 1", signal.SIGTERM),
            ("handled 2", signal.SIGINT),
            ("handled 3", None),
            ("15", signal.SIGINT),
            ("second Ctrl-C: KeyboardInterrupt", None),
        ]:
            # A bound for a hung child only: on time the line comes in well under a minute, even on a loaded machine.
            assert lines.get(timeout=600) == line + "\n", stopped(child)  # "" when the child has ended
            if signum is not None:
                child.send_signal(signum)
        assert child.wait(timeout=600) == 0, stopped(child)
    finally:
        child.kill()


def test_a_cpu_process_without_a_gpu_of_its_own_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Two CPU processes on a machine with one GPU (faked: this machine has none): the second would fail on cuda:1,
    where Accelerate's barriers allocate; the trainer says what to do instead. The first one, and GPU runs (Accelerate
    maps rank r to cuda:r % count), are left alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="^cpu: this CPU run has 2 processes .* 1 GPU.* hide the GPUs"):
        train(parse_config(tiny_argv(tmp_path / "run", cpu="true", pseudo_steps=1, real_steps=0, warmup_steps=1)))
    assert not (tmp_path / "run").exists()
    check_gpu_per_process(False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_gpu_per_process(True)


def test_a_run_that_does_not_use_deepspeed_does_not_import_it(tmp_path):
    """DeepSpeed's import prints "Setting accelerator to CPU" into the progress bar: a one-process run (fresh process,
    as `hf-p2r train` starts) leaves it unimported, and what it prints holds no line of it."""
    pytest.importorskip("deepspeed")  # the check means something only where it is installed
    argv = tiny_argv(tmp_path / "run", pseudo_steps=1, real_steps=1, eval_steps=0, corpus_max_bytes=5000)
    code = f"""
import json, sys
from hf_p2r.cli import main
code = main(["train", *{[str(arg) for arg in argv]!r}])
print(json.dumps([code, "deepspeed" in sys.modules]))
"""
    env = {name: value for name, value in subprocess_env().items() if name != "DS_ACCELERATOR"}  # as a user's: the
    # accelerator left to DeepSpeed's detection, which is what prints the line (tests/conftest.py names it)
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, False], done.stderr[-3000:]
    assert "Setting accelerator" not in done.stdout + done.stderr
