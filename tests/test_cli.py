"""The `hf-p2r` command line: start-up stays light (its docstring's promise), so every command's time and memory are
the command's own (`benchmarks/convert.md` counts the converter's)."""

import json
import subprocess
import sys

import pytest

# Imported by the trainer, not by any `hf-p2r` command before it runs.
TRAINER_ONLY = ["hf_p2r.training", "hf_p2r.training.train", "datasets"]


@pytest.mark.parametrize("command", ["convert", "push", "plan"])
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
