"""Configuration: YAML + command-line overrides, and one clear error naming the field for every bad value."""

import importlib.util
import os
import subprocess
import threading

import pytest
import torch

from hf_p2r import P2RForCausalLM
from hf_p2r.training import ConfigError, parse_config
from hf_p2r.training.config import MAX_CONFIG_BYTES, even_delink_steps

from .helpers import PYTHON, REPO, demo_launch, subprocess_env


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_command_line_overrides_yaml(tmp_path):
    text = "pseudo_steps: 7\nreal_steps: 3\nwarmup_steps: 2\nlearning_rate: 3e-4\noptimizer_carry: copy\n"
    path = _yaml(tmp_path, text)
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
    command = " ".join(demo_launch())
    assert command.startswith("accelerate launch -q ")
    assert command.endswith(" scripts/train.py --config configs/demo.yaml")
    assert f"make demo # = {command}" in readme


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
        ("pseudo_steps: 1.5\n", [], "config: {config}: pseudo_steps: expected an integer, got 1.5"),
        ("pseudo_steps: -1\n", [], "pseudo_steps: must satisfy 0 <= pseudo_steps"),
        ("optimizer_carry: cpy\n", [], "optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'"),
        ("", ["--optimizer_carry", "cpy"], "--optimizer_carry/--optimizer-carry: invalid choice: 'cpy'"),
        ("", ["--pseudo_steps", "many"], "--pseudo_steps/--pseudo-steps: invalid int value: 'many'"),
        ("", ["--no_such_field", "1"], "unrecognized arguments: --no_such_field 1"),
        ("learning_rate: 0\n", [], "learning_rate: must satisfy 0.0 < learning_rate"),
        ("validation_fraction: 1\n", [], "validation_fraction: must satisfy"),
        ("train_files: a.txt\n", [], "config: {config}: train_files: expected a list (a string each), got 'a.txt'"),
        ("num_unique_layers: 8\n", [], "num_unique_layers: the pseudo model needs fewer blocks than layers (8)"),
        ("num_key_value_heads: 3\n", [], "num_key_value_heads: 3 must divide num_attention_heads (4)"),
        ("hidden_size: 130\n", [], "model: hidden_size (130) must be a multiple of num_attention_heads (4)"),
        ("partial_delink_steps: [5]\npartial_delink_blocks: [2]\npseudo_steps: 5\n", [], "partial_delink_steps:"),
        ("partial_delink_steps: [5]\n", [], "partial_delink_blocks: one entry per partial_delink_steps entry"),
        (
            "num_unique_layers: 2\npartial_delink_steps: [5]\npartial_delink_blocks: [3]\n",
            [],
            "partial_delink_blocks: num_unique_layers=3 cannot be reached from 2",
        ),
        ("pseudo_steps: 0\nreal_steps: 0\n", [], "real_steps: pseudo_steps + real_steps must be at least 1"),
        ("- a list\n", [], "must hold FIELD: VALUE lines"),
        (
            "pseudo_steps: 10\nreal_steps: 10\nwarmup_steps: 30\n",
            [],
            "warmup_steps: the warm-up (30 steps) is longer than the run (20 steps: pseudo_steps + real_steps); pass "
            "--warmup_steps 20 or less",
        ),
        ("", ["--pseudo_step", "10"], "unrecognized arguments: --pseudo_step 10 (did you mean --pseudo_steps? see"),
        ("", ["--learning_rate", "nan"], "learning_rate: expected a finite number, got nan"),
        ("learning_rate: abc\n", [], "config: {config}: learning_rate: expected a finite number, got 'abc'"),
        (f"learning_rate: {10**400}\n", [], "config: {config}: learning_rate: expected a finite number, got 1000"),
        ("num_experts: 4\nnum_experts_per_tok: 5\n", [], "model: num_experts_per_tok (5) must be at most num_experts"),
        ("partial_delink_blocks: [2, 4]\npseudo_steps: 2\n", [], "partial_delink_blocks: 2 partial delinks need a"),
        ("partial_delink_steps: [3]\npseudo_steps: 0\n", [], "partial_delink_steps: partial delinks need a pseudo"),
    ],
)
def test_bad_values_raise_one_line_naming_the_field(tmp_path, yaml_text, argv, message):
    config = _yaml(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as error:
        parse_config(["--config", config, *argv])
    assert message.format(config=config) in str(error.value)
    assert "\n" not in str(error.value)


def test_script_prints_one_line_and_exits_2(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts/train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--config", _yaml(tmp_path, "optimizer_carry: cpy\n")]) == 2
    captured = capsys.readouterr()
    config = tmp_path / "config.yaml"
    assert captured.err == (
        f"train.py: error: config: {config}: optimizer_carry: expected one of 'reset', 'copy', 'scale', got 'cpy'\n"
    )
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
    from hf_p2r.config import SECTIONS

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name, section in SECTIONS.items():
        assert f"{name} ({section.__name__}):" in text, name  # one group per section
        for field in section.__dataclass_fields__:
            assert f"--{field}" in text, field


DEMO = ["--config", str(REPO / "configs/demo.yaml")]


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(argv)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_partial_delinks_are_evenly_spaced_over_the_pseudo_stage_unless_given():
    """The README's override on the demo: its growth (partial_delink_blocks: [2, 4], steps left out) follows
    pseudo_steps. The presets' former explicit steps are exactly the derived ones, so their runs are unchanged, and
    the resolved steps are what train_config.yaml records."""
    assert parse_config([*DEMO, "--pseudo_steps", "50"]).delink_schedule() == [(17, 2), (33, 4), (50, 8)]
    assert even_delink_steps(80, 2) == [27, 53] and even_delink_steps(3300, 4) == [660, 1320, 1980, 2640]
    gpu = parse_config(["--config", str(REPO / "configs/gpu_1b.yaml")])
    assert gpu.delink_schedule()[:-1] == [(660, 2), (1320, 4), (1980, 8), (2640, 16)]
    assert gpu.to_dict()["partial_delink_steps"] == [660, 1320, 1980, 2640]
    given = parse_config([*DEMO, "--pseudo_steps", "50", "--partial_delink_steps", "10", "40"])
    assert given.delink_schedule() == [(10, 2), (40, 4), (50, 8)]
    # A real model trained from scratch has no pseudo stage to grow in: the demo's growth is unused.
    assert parse_config([*DEMO, "--pseudo_steps", "0"]).delink_schedule() == []
    for pseudo_steps in range(1, 60):
        for count in range(pseudo_steps):
            steps = even_delink_steps(pseudo_steps, count)
            assert steps == sorted(set(steps)) and all(0 < step < pseudo_steps for step in steps)


def test_given_steps_outside_the_pseudo_stage_say_what_to_pass(tmp_path):
    config = _yaml(tmp_path, "partial_delink_steps: [27, 53]\npartial_delink_blocks: [2, 4]\npseudo_steps: 80\n")
    assert _error(["--config", config, "--pseudo_steps", "50"]) == (
        "partial_delink_steps: steps must increase and lie in (0, pseudo_steps=50), got [27, 53]; leave it out "
        "(--partial_delink_steps none) for evenly spaced steps ([17, 33]) or give steps in that range"
    )
    cleared = parse_config(["--config", config, "--pseudo_steps", "50", "--partial_delink_steps", "none"])
    assert cleared.delink_schedule() == [(17, 2), (33, 4), (50, 8)]
    assert _error(["--config", config, "--pseudo_steps", "2", "--partial_delink_steps"]) == (
        "partial_delink_blocks: 2 partial delinks need a pseudo stage of more than 2 steps, got pseudo_steps=2; give "
        "fewer partial_delink_blocks (--partial_delink_blocks none clears them) or more pseudo_steps"
    )


@pytest.mark.parametrize("clear", [["none"], ["[]"], []], ids=["none", "brackets", "no value"])
def test_a_list_flag_is_cleared_by_none_brackets_or_no_value(clear):
    argv = [*DEMO, "--partial_delink_blocks", *clear, "--train_files", *clear, "--pipeline_split", *clear]
    config = parse_config([*argv, "--mlp_only_layers", *clear])
    assert config.train.partial_delink_blocks == [] and config.delink_schedule() == [(80, 8)]
    assert (config.data.train_files, config.model.mlp_only_layers) == ([], [])
    assert config.train.pipeline_split is None  # an optional list: cleared to its default
    assert parse_config([*DEMO, "--partial_delink_blocks", "2"]).delink_schedule() == [(40, 2), (80, 8)]


def test_yaml_values_read_as_the_command_line_reads_them(tmp_path):
    """null clears a list, 3e-4 (a string to YAML) is a number, `no` (false to YAML) is the choice "no"."""
    text = "partial_delink_blocks: null\npipeline_split: null\nlearning_rate: 3e-4\nmixed_precision: no\ncpu: 'yes'\n"
    config = parse_config(["--config", _yaml(tmp_path, text)])
    assert (config.train.partial_delink_blocks, config.train.pipeline_split) == ([], None)
    assert (config.train.learning_rate, config.train.mixed_precision, config.train.cpu) == (3e-4, "no", True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pseudo_step", "10"], "unrecognized arguments: --pseudo_step 10 (did you mean --pseudo_steps? see --help"),
        (["--pseudo", "10"], "unrecognized arguments: --pseudo 10"),
        (["--conf", "configs/demo.yaml"], "unrecognized arguments: --conf configs/demo.yaml"),
        (["--config"], "argument --config: expected one argument"),  # the pre-parser's error, one line too
        (["--pseudo_steps"], "argument --pseudo_steps/--pseudo-steps: expected one argument"),
    ],
)
def test_abbreviated_flags_are_refused_and_the_pre_parser_raises_one_line(argv, message):
    assert _error(argv).startswith(message)


def test_offload_indices_the_first_model_lacks_suggest_a_ratio_or_auto():
    assert _error([*DEMO, "--offload", "[1, 3, 5]"]) == (
        "offload: block indices [1, 3, 5] must exist in every model of the run (1 -> 2 -> 4 -> 8 blocks: the first "
        "has blocks 0..0); give a ratio of the blocks (0.5) or auto, which choose again after each delink"
    )
    assert parse_config([*DEMO, "--offload", "[0]"]).train.offload_spec == [0]


def _billion_laughs(levels: int = 9) -> bytes:
    lines = ["train_files:", "  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines).encode() + b"\n"


def _without_hanging(call, limit_s: float = 120.0):
    """`call()`'s result (or its exception), failing the test if it has not returned after `limit_s`: a hang detector
    for inputs that once expanded or recursed without end, not a speed claim (parsing takes milliseconds)."""
    outcome = []

    def run():
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the test's thread
            outcome.append((False, error))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit_s)
    assert outcome, f"still running after {limit_s} s: the input makes the parser hang"
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "is not valid YAML (nested too deeply)"),
        (b"a: " + b"{x: " * 1_000 + b"1" + b"}" * 1_000 + b"\n", "is not valid YAML (nested too deeply)"),
        (b"#" * MAX_CONFIG_BYTES + b"\n", "is over 1 MiB, too large for a configuration"),
        (b"seed: \xff\n", "is not UTF-8 text (byte 6)"),
        (b"seed: 2001-02-30\n", "is not valid YAML (day is out of range for month)"),
        (
            b"pseudo_steps: [1\n",
            "is not valid YAML (line 2: while parsing a flow sequence, expected ',' or ']', but got",
        ),
        (
            b"seed: 1\n---\nseed: 2\n",
            "is not valid YAML (line 2: expected a single document in the stream, but found another",
        ),
        (
            b"seed: !!python/object/apply:os.system [ls]\n",
            "is not valid YAML (line 1: could not determine a constructor for the tag",
        ),
        (b"seed: \x00\n", "is not valid YAML (unacceptable character #x0000"),
        (b"pipeline_split: &a [*a]\n", ": pipeline_split: expected a list (an integer each) or null, got [[[["),
        (_billion_laughs(), ": train_files: expected a list (a string each), got [['lol', 'lol', 'lol', 'lol',"),
        (b"seed: 2001-02-03\n", ": seed: expected an integer, got datetime.date(2001, 2, 3)"),
        (b"? [a, b]\n: 1\n", "is not valid YAML (line 1: while constructing a mapping, found unhashable key)"),
        (b"1: 2\n", ": unknown key 1"),
    ],
)
def test_any_yaml_file_ends_in_one_line_naming_it(tmp_path, data, problem):
    """Malformed, too deep, too large, self-referencing or exponentially aliased YAML: one line naming the file, at
    once (no RecursionError, no traceback, no expansion)."""
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    message = _without_hanging(lambda: _error(["--config", str(path)]))
    assert message.startswith(f"config: {path}") and problem in message, message
    assert len(message) < 500


def test_a_fifo_a_folder_a_device_or_a_missing_file_as_config_is_one_line_without_blocking(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    result = []
    reader = threading.Thread(target=lambda: result.append(_error(["--config", str(fifo)])), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert result == [f"config: {fifo} is not a regular file"]
    assert _error(["--config", str(tmp_path)]) == f"config: {tmp_path} is not a regular file"
    assert _error(["--config", "/dev/zero"]) == "config: /dev/zero is not a regular file"
    missing = tmp_path / "missing.yaml"
    assert _error(["--config", str(missing)]) == f"config: cannot read {missing}: No such file or directory"
    assert _error(["--config", "bad\nname.yaml"]) == "config: cannot read 'bad\\nname.yaml': No such file or directory"


SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_experts")
SIZES += ("moe_intermediate_size", "num_unique_layers", "block_size", "pseudo_steps", "corpus_max_bytes")


@pytest.mark.parametrize("preset", ["demo", "demo_moe"])
@pytest.mark.parametrize("field", SIZES)
def test_absurd_sizes_end_parsing_at_once(preset, field):
    """Parsing builds the model's config to check its shapes, and checks every delink over the depths: a size such as
    10**9 layers is refused by the model's bounds (hf_p2r.models.p2r) before anything scales with it, or scales
    nothing at all; either way the parser answers at once."""
    argv = ["--config", str(REPO / f"configs/{preset}.yaml"), f"--{field}", str(10**9)]
    try:
        _without_hanging(lambda: parse_config(argv))
    except ConfigError as error:
        assert "\n" not in str(error)


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--offload", "0.5", "--offload_update", "during_backward", "--max_grad_norm", "1.0"], "offload_update"),
        (["--offload", "0.5", "--offload_host_threads", "0"], "offload_host_threads"),
        (["--offload", "0.5", "--offload_grad_accumulation", "gpu"], "argument --offload_grad_accumulation"),
    ],
)
def test_offload_designs_are_checked_where_declared(flags, field):
    """The offload designs' fields are refused in one line naming the field before any torch work: a step during the
    backward cannot clip, host threads are at least 1, a choice outside its list."""
    with pytest.raises(ConfigError, match=f"^{field}"):
        parse_config(["--cpu", "true", *flags])
    config = parse_config(
        ["--cpu", "true", "--offload", "0.5", "--offload_update", "during_backward", "--max_grad_norm", "0"]
    )
    assert config.offload.offload_update == "during_backward" and config.optim.max_grad_norm == 0
