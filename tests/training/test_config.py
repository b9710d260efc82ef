"""Configuration: YAML + command-line overrides, and one clear error naming the field for every bad value."""

import importlib.util
import subprocess

import pytest
import torch

from hf_p2r import P2RForCausalLM
from hf_p2r.training import parse_config

from .helpers import PYTHON, REPO, subprocess_env


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_command_line_overrides_yaml(tmp_path):
    path = _yaml(tmp_path, "pseudo_steps: 7\nreal_steps: 3\nlearning_rate: 3e-4\noptimizer_carry: copy\n")
    config = parse_config(
        ["--config", path, "--real_steps", "5", "--partial_delink_steps", "2"] + ["--partial_delink_blocks", "2"]
    )
    assert (config.train.pseudo_steps, config.train.real_steps, config.train.optimizer_carry) == (7, 5, "copy")
    assert config.train.learning_rate == 3e-4  # YAML reads 3e-4 as a string: converted like a command-line value
    assert config.delink_schedule() == [(2, 2), (7, 8)]
    assert [config.blocks_at(step) for step in (0, 1, 2, 6, 7, 12)] == [1, 1, 2, 2, 8, 8]


def test_demo_config_is_what_the_readme_describes():
    """configs/demo.yaml through the real parser (which validates it), against the README's description of the demo
    (the demo test in test_launch.py runs it shrunk to a tiny model)."""
    config = parse_config(["--config", str(REPO / "configs/demo.yaml")])
    model, train = config.model, config.train
    assert (model.num_hidden_layers, model.num_unique_layers, model.sharing_pattern) == (8, 1, "cycle")
    assert (train.pseudo_steps, train.real_steps, train.total_steps) == (80, 160, 240)
    assert config.delink_schedule() == [(27, 2), (53, 4), (80, 8)]
    assert [config.blocks_at(step) for step in (0, 27, 53, 79, 80, 239)] == [1, 2, 4, 4, 8, 8]
    # Nothing to download: the standard library's sources and the built-in byte-level tokenizer.
    assert (config.data.dataset_name, config.data.train_files, config.data.tokenizer_name) == (None, [], None)

    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    depth, blocks = (
        model.num_hidden_layers,
        " → ".join(map(str, [model.num_unique_layers, *train.partial_delink_blocks])),
    )
    assert f"trains a pseudo model ({depth} layers sharing {blocks} blocks) for {train.pseudo_steps} steps" in readme
    assert (
        f"into the real model ({depth} blocks, same function) and trains that for {train.real_steps} more steps"
        in readme
    )
    command = "accelerate launch -q --num_processes 1 scripts/train.py --config configs/demo.yaml"
    assert f"make demo # = {command}" in readme
    assert command in (REPO / "Makefile").read_text(encoding="utf-8")


def test_gpu_1b_config_is_a_one_billion_parameter_model():
    config = parse_config(["--config", str(REPO / "configs/gpu_1b.yaml")])
    counts = {}
    for blocks in (config.model.num_unique_layers, config.model.num_hidden_layers):
        with torch.device("meta"):  # shapes only, no memory
            model = P2RForCausalLM(config.p2r_config(config.model.vocab_size, blocks, special_tokens={}))
        counts[blocks] = sum(p.numel() for p in model.parameters())
    assert counts == {1: 148_117_504, 20: 1_004_881_920}  # the numbers stated in configs/gpu_1b.yaml


@pytest.mark.parametrize(
    ("yaml_text", "argv", "message"),
    [
        ("pseudo_step: 3\n", [], "unknown key 'pseudo_step' (did you mean 'pseudo_steps'?)"),
        ("pseudo_steps: 1.5\n", [], "pseudo_steps: expected an integer, got 1.5"),
        ("pseudo_steps: -1\n", [], "pseudo_steps: must satisfy 0 <= pseudo_steps"),
        ("optimizer_carry: cpy\n", [], "optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'"),
        ("", ["--optimizer_carry", "cpy"], "--optimizer_carry/--optimizer-carry: invalid choice: 'cpy'"),
        ("", ["--pseudo_steps", "many"], "--pseudo_steps/--pseudo-steps: invalid int value: 'many'"),
        ("", ["--no_such_field", "1"], "unrecognized arguments: --no_such_field 1"),
        ("learning_rate: 0\n", [], "learning_rate: must satisfy 0.0 < learning_rate"),
        ("validation_fraction: 1\n", [], "validation_fraction: must satisfy"),
        ("train_files: a.txt\n", [], "train_files: expected a list (a string each), got 'a.txt'"),
        ("num_unique_layers: 8\n", [], "num_unique_layers: the pseudo model needs fewer blocks than layers (8)"),
        ("num_key_value_heads: 3\n", [], "num_key_value_heads: 3 must divide num_attention_heads (4)"),
        ("hidden_size: 130\n", [], "model: The hidden size (130) is not a multiple of the number of attention heads"),
        ("partial_delink_steps: [5]\npartial_delink_blocks: [2]\npseudo_steps: 5\n", [], "partial_delink_steps:"),
        ("partial_delink_steps: [5]\n", [], "partial_delink_blocks: one entry per partial_delink_steps entry"),
        (
            "num_unique_layers: 2\npartial_delink_steps: [5]\npartial_delink_blocks: [3]\n",
            [],
            "partial_delink_blocks: num_unique_layers=3 cannot be reached from 2",
        ),
        ("pseudo_steps: 0\nreal_steps: 0\n", [], "real_steps: pseudo_steps + real_steps must be at least 1"),
        ("- a list\n", [], "must hold FIELD: VALUE lines"),
    ],
)
def test_bad_values_raise_one_line_naming_the_field(tmp_path, yaml_text, argv, message):
    with pytest.raises(ValueError) as error:
        parse_config(["--config", _yaml(tmp_path, yaml_text), *argv])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_script_prints_one_line_and_exits_2(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts/train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--config", _yaml(tmp_path, "optimizer_carry: cpy\n")]) == 2
    captured = capsys.readouterr()
    assert captured.err == "train.py: error: optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'\n"
    assert captured.out == ""


@pytest.mark.parametrize(
    ("yaml_text", "argv", "message"),
    [
        ("pseudo_step: 3\n", [], "config: {config}: unknown key 'pseudo_step' (did you mean 'pseudo_steps'?)"),
        ("", ["--pseudo_steps", "many"], "argument --pseudo_steps/--pseudo-steps: invalid int value: 'many'"),
        ("num_unique_layers: 8\n", [], "num_unique_layers: the pseudo model needs fewer blocks than layers (8), got 8"),
    ],
)
def test_cli_prints_one_line_without_a_traceback_and_exits_2(tmp_path, yaml_text, argv, message):
    """The real command in a subprocess, for a bad value from each source: the YAML file, the command line, and the
    checks that compare fields."""
    config = _yaml(tmp_path, yaml_text)
    command = [PYTHON, str(REPO / "scripts/train.py"), "--config", config, *argv]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"train.py: error: {message.format(config=config)}"], result.stderr


def test_help_lists_every_field(capsys):
    from hf_p2r.training.config import DataArguments, ModelArguments, TrainArguments

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for arguments in (ModelArguments, DataArguments, TrainArguments):
        for name in arguments.__dataclass_fields__:
            assert f"--{name}" in text, name
