"""The `hf-p2r` command line: start-up stays light (its docstring's promise), so every command's time and memory are
the command's own (`benchmarks/convert.md` counts the converter's)."""

import json
import os
import platform
import subprocess
import sys

import pytest

# Imported by the trainer, not by any `hf-p2r` command before it runs.
TRAINER_ONLY = ["hf_p2r.training", "hf_p2r.training.train", "datasets"]


@pytest.mark.parametrize("command", ["convert", "export", "push", "plan", "env"])
def test_building_the_command_line_imports_no_trainer_module(command):
    code = f"""
import json, sys
from hf_p2r.cli import main
try:
    main([{command!r}, "--help"])   # builds every subcommand's parser, then exits
except SystemExit:
    pass
print(json.dumps([name for name in {TRAINER_ONLY!r} if name in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_check_can_fail():
    """The probe sees a trainer module when one is imported (so an empty list above means something)."""
    code = f"""
import json, sys
import hf_p2r.training.offload
print(json.dumps([name for name in {TRAINER_ONLY!r} if name in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "hf_p2r.training" in json.loads(done.stdout.strip().splitlines()[-1])


HEAVY = ["torch", "transformers"]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["convert", "--help"],
        ["convert", "only-src"],
        ["convert", "a", "b", "--target", "gguf"],
        ["export", "--help"],
        ["export", "only-checkpoint"],
        ["nope"],
        ["plan", "--help"],
        ["plan", "--config", "c", "--gpus", "8", "--precision", "fp4"],
        ["plan", "--config", "c", "--gpus", "8", "--gpu-memory", "lots"],
        ["push", "--help"],
        ["env", "--help"],
    ],
    ids=[
        "help",
        "convert help",
        "missing argument",
        "bad choice",
        "export help",
        "export missing argument",
        "unknown command",
        "plan help",
        "plan bad choice",
        "plan bad size",
        "push help",
        "env help",
    ],
)
def test_help_and_argument_errors_import_neither_torch_nor_transformers(args):
    code = f"""
import json, sys
from hf_p2r.cli import main
try:
    main({args!r})
except SystemExit:
    pass
print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_import_hf_p2r_is_light_and_still_registers_the_auto_classes(tmp_path):
    """`import hf_p2r` loads no torch; the Auto classes know P2R once transformers loads them, in either order."""
    code = """
import json, sys
import hf_p2r
light = "torch" not in sys.modules
from transformers import AutoConfig, AutoModelForCausalLM
from hf_p2r import P2RConfig
model_class = AutoModelForCausalLM._model_mapping[P2RConfig]
print(json.dumps([light, AutoConfig.for_model("p2r").model_type, model_class.__name__]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, "p2r", "P2RForCausalLM"]


def test_env_prints_versions_and_hardware_but_no_secret(monkeypatch):
    env = dict(os.environ, HF_TOKEN="hf_secret_token_123", WANDB_API_KEY="wandb_secret_456")
    done = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "env"], capture_output=True, text=True, check=True, env=env
    )
    fields = dict(line[2:].split(": ", 1) for line in done.stdout.splitlines() if line.startswith("- "))
    for key in ("hf-p2r", "Python", "torch", "transformers", "accelerate", "datasets", "safetensors",
                "huggingface_hub", "deepspeed"):  # fmt: skip
        assert key in {name.removesuffix(" version") for name in fields}, key
    assert fields["hf-p2r version"] == "0.1.0" and fields["Python version"] == platform.python_version()
    assert fields["CUDA available"] in ("True", "False") and fields["CPUs"].startswith(str(os.cpu_count()))
    assert "Platform" in fields
    assert "secret" not in done.stdout + done.stderr


def test_train_hands_every_argument_to_the_trainers_parser(capsys):
    """`hf-p2r train` has no option of its own: `--help` is the trainer's (every field), under the command's name; its
    line in `hf-p2r --help` says how to start several processes."""
    from hf_p2r.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: hf-p2r train [--config FILE] [--FIELD VALUE ...]")
    assert "--pseudo_steps" in shown and "--pipeline_schedule" in shown
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "accelerate launch -m hf_p2r.train" in " ".join(capsys.readouterr().out.split())


def test_the_trainer_imports_its_modules_uncollected_and_frozen(monkeypatch, tmp_path):
    """`hf_p2r.train.main` imports the trainer with the garbage collector off, freezes what exists (`gc.freeze`) and
    runs with the collector on (a stand-in for `hf_p2r.training` records the collector's state at each point)."""
    import gc
    import types

    from hf_p2r import train as entry

    seen = {}

    def train(config):
        seen["collector on while training"] = gc.isenabled()
        seen["frozen"] = gc.get_freeze_count()
        return 0

    def imported(name):
        if name not in ("NonFiniteLossError", "train"):
            raise AttributeError(name)
        seen.setdefault("collector on while importing", gc.isenabled())
        return RuntimeError if name == "NonFiniteLossError" else train

    stand_in = types.ModuleType("hf_p2r.training")
    stand_in.__getattr__ = imported
    monkeypatch.setitem(sys.modules, "hf_p2r.training", stand_in)
    monkeypatch.setattr(entry, "set_malloc", lambda: False)  # (this process's allocator is not the test's)
    frozen_before = gc.get_freeze_count()
    try:
        assert entry.main(["--output_dir", str(tmp_path / "run")]) == 0
    finally:
        if not frozen_before:
            gc.unfreeze()
    assert seen.pop("frozen") > frozen_before
    assert seen == {"collector on while importing": False, "collector on while training": True}
