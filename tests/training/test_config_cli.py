"""`hf-p2r train`'s configuration from the command line: `--help` and every configuration error answer without torch
or transformers (a fresh process each, as a user's shell starts one), a YAML file given without `--config` says how to
give it, and the planner refuses what the trainer refuses, in the same line (one validator)."""

import json
import subprocess
import sys

import pytest

from .helpers import REPO, subprocess_env

HEAVY = ["torch", "transformers"]
PROBE = """
import json, sys
from hf_p2r.cli import main
try:
    code = main({args!r})
except SystemExit as done:
    code = done.code
print(json.dumps([code, [name for name in {heavy!r} if name in sys.modules]]))
"""


def run_cli(args: list[str], cwd=REPO) -> tuple[int, list[str], str]:
    """(exit code, the heavy modules imported, what it printed: stderr, then stdout) of `hf-p2r ARGS` in a fresh
    process."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args, heavy=HEAVY)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=cwd,
        timeout=300,
    )
    *printed, probe = done.stdout.strip().splitlines()
    code, imported = json.loads(probe)
    return code, imported, done.stderr + "\n".join(printed)


def test_train_help_lists_every_field_without_importing_torch_or_transformers():
    from hf_p2r.config.parse import field_types

    code, imported, shown = run_cli(["train", "--help"])
    assert (code, imported) == (0, [])
    missing = [name for name in field_types() if f"--{name} " not in shown and f"--{name}," not in shown]
    assert not missing


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("pseudo_step: 3\n", [], "unknown key 'pseudo_step' (did you mean 'pseudo_steps'?)"),
        ("optimizer_carry: cpy\n", [], "optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'"),
        ("hidden_size: 130\n", [], "model: hidden_size (130) must be a multiple of num_attention_heads (4)"),
        ("", ["--pseudo_steps", "many"], "argument --pseudo_steps/--pseudo-steps: invalid int value: 'many'"),
        ("", ["--learning_rate", "nan"], "learning_rate: expected a finite number, got nan"),
        ("", ["--pipeline_parallel_size", "2", "--pipeline_split", "3", "4"], "pipeline_split: [3, 4] must give 2"),
    ],
    ids=["yaml typo", "yaml choice", "model shape", "flag type", "flag value", "pipeline split"],
)
def test_a_configuration_error_is_one_line_without_importing_torch_or_transformers(tmp_path, yaml_text, flags, message):
    config = tmp_path / "run.yaml"
    config.write_text(yaml_text)
    code, imported, shown = run_cli(["train", "--config", str(config), *flags])
    assert (code, imported) == (2, [])
    lines = shown.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-p2r train: error: ") and message in lines[0], shown


def test_the_check_can_fail():
    """The probe sees torch where a command imports it (so an empty list above means something)."""
    code, imported, _ = run_cli(["env"])
    assert code == 0 and "torch" in imported


def test_a_yaml_file_given_without_config_is_hinted(tmp_path):
    """The file named as the user typed it (relative: a long path is shortened in the one-line message, as
    pytest-xdist's temporary folders are)."""
    (tmp_path / "my.yaml").write_text("pseudo_steps: 3\n")
    code, imported, shown = run_cli(["train", "my.yaml"], cwd=tmp_path)
    assert (code, imported) == (2, [])
    assert "a configuration file is given with --config: hf-p2r train --config my.yaml;" in shown


def test_the_planner_refuses_what_the_trainer_refuses_in_the_same_line(tmp_path):
    """A pipeline_split that does not add up to the layers (issue 36): `hf-p2r plan --config run.yaml` and
    `hf-p2r train --config run.yaml` end with the same line (the rules module both read the YAML with)."""
    config = tmp_path / "run.yaml"
    config.write_text("num_hidden_layers: 8\npipeline_parallel_size: 2\npipeline_split: [3, 4]\n")
    expected = "pipeline_split: [3, 4] must give 2 stages at least one layer each, 8 layers in all"
    _, _, planned = run_cli(["plan", "--config", str(config), "--gpus", "8"])
    _, _, trained = run_cli(["train", "--config", str(config)])
    assert planned.splitlines()[0] == f"hf-p2r plan: error: {expected}"
    assert trained.splitlines()[0] == f"hf-p2r train: error: {expected}"
