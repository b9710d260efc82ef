"""`hf-p2r plan` on bad or hostile input (issue 23): one line naming the file, field or flag, exit 2, within seconds,
nothing read out of the folder given; every number bounded before the planner's work grows with it; property tests
over the config dicts and NAME=VALUE overrides it parses. And the table says how to see the rows it leaves out."""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_p2r.cli import main
from hf_p2r.commands.plan import _assumptions, parse_size
from hf_p2r.errors import InputError
from hf_p2r.planning import PRECISIONS, Hardware, estimate, parameter_tensors
from hf_p2r.planning.assumptions import MAX_MEMORY, check_int
from hf_p2r.planning.memory import model_state_bytes, pipeline_stages, stage_tensors
from hf_p2r.planning.plan import _divisors, candidate_layouts, pseudo_and_real, read_config

from ..conftest import tiny_config
from ..models.test_modeling_p2r_moe import moe_config
from .test_plan import workload

TINY = tiny_config().to_dict()


def _write(path: Path, values) -> Path:
    path.write_text(json.dumps(values))
    return path


def _plan(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str, *parts: str) -> None:
    assert err.startswith("hf-p2r plan: error: ") and err.count("\n") == 1, err
    assert all(part in err for part in parts), err


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, more than any model has"),
        ("hidden_size", -64, "hidden_size must be a positive integer, got -64"),
        ("vocab_size", 10**15, "vocab_size is 1000000000000000, more than any model has"),
        ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
        ("intermediate_size", "64", "intermediate_size"),
        ("num_unique_layers", 10**9, "num_unique_layers"),
    ],
)
def test_config_sizes_are_checked_before_anything_is_built(tmp_path, capsys, field, value, message):
    """The model's own validators (with their bounds) run on config.json before any list, model or meta tensor is
    built from it. (The bounds are `hf_p2r.models.p2r.sharing_p2r`'s.)"""
    folder = tmp_path / "model"
    folder.mkdir()
    _write(folder / "config.json", {**TINY, "share_layers": field == "num_unique_layers", field: value})
    code, out, err = _plan(capsys, "--config", str(folder), "--gpus", "8")
    assert code == 2 and out == ""
    _one_line(err, f"{folder / 'config.json'}: ", message)


def _run_plan(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "plan", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_a_huge_depth_is_one_line_in_a_fresh_process(tmp_path):
    """It used to hang (a list per depth, then a meta model of 10**9 layers) and ignore SIGTERM."""
    config = _write(tmp_path / "deep.json", {**TINY, "num_hidden_layers": 10**9})
    result = _run_plan("--config", str(config), "--gpus", "8", "--max-pp", "1000000")
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr == (
        f"hf-p2r plan: error: {config}: num_hidden_layers is 1000000000, more than any model has (at most 10000)\n"
    )


def test_a_fifo_for_a_config_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: it is never opened."""
    os.mkfifo(tmp_path / "config.json")
    for path in (tmp_path, tmp_path / "config.json"):
        result = _run_plan("--config", str(path), "--gpus", "8")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.startswith(f"hf-p2r plan: error: {tmp_path / 'config.json'}: ")
        assert "FIFO" in result.stderr and result.stderr.count("\n") == 1


def test_a_config_json_linking_out_of_its_folder_is_not_read(tmp_path, capsys):
    secret = _write(tmp_path / "elsewhere.json", TINY)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to(secret)
    code, out, err = _plan(capsys, "--config", str(folder), "--gpus", "8")
    assert code == 2 and out == ""
    _one_line(err, f"{folder / 'config.json'}: a link out of {folder}")


@pytest.mark.parametrize(
    "content,message",
    [
        ("[" * 100_000, "not valid JSON (nested too deeply)"),
        ('{"model_type": "p2r", ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got array"),
        ('{"model_type": ["p2r"]}', "model_type must be 'p2r', 'p2r_moe' or 'llama', got ['p2r']"),
        ('{"model_type": "' + "x" * 10_000 + '"}', "model_type must be 'p2r', 'p2r_moe' or 'llama', got 'xxxx"),
    ],
    ids=["deep", "truncated", "array", "model_type list", "long model_type"],
)
def test_malformed_json_is_one_short_line(tmp_path, capsys, content, message):
    (tmp_path / "c.json").write_text(content)
    code, _, err = _plan(capsys, "--config", str(tmp_path / "c.json"), "--gpus", "8")
    assert code == 2 and len(err) < 600
    _one_line(err, f"{tmp_path / 'c.json'}: {message}")


def test_a_field_the_validators_do_not_cover_is_one_line(tmp_path, capsys):
    config = _write(tmp_path / "c.json", {**TINY, "hidden_act": "no-such-activation"})
    code, _, err = _plan(capsys, "--config", str(config), "--gpus", "8")
    assert code == 2
    _one_line(err, f"{config}: cannot build the model from it: KeyError")


def test_a_partial_delink_that_breaks_the_moe_pattern_is_one_line(tmp_path, capsys):
    """--num-unique-layers is set after the config was built: checked again by the model's validators."""
    moe_config(decoder_sparse_step=2).save_pretrained(tmp_path)
    code, _, err = _plan(capsys, "--config", str(tmp_path), "--gpus", "8", "--num-unique-layers", "3")
    assert code == 2
    _one_line(err, "num_unique_layers=3: decoder_sparse_step=2")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", str(10**11)], "--gpus must be at most 1048576, got 100000000000"),
        (["--gpus", "8", "--gpus-per-node", "100000"], "--gpus-per-node must be at most 1024"),
        (["--gpus", "8", "--seq-len", str(10**9)], "--seq-len must be at most 16777216"),
        (["--gpus", "8", "--micro-batch", str(2 * 10**9)], "--micro-batch must be at most 1073741824"),
        (["--gpus", "8", "--global-batch", str(10**20)], "--global-batch must be at most 1073741824, got 1e+20"),
        (["--gpus", "1048576", "--micro-batch", "100000"], "global_batch must be at most 1073741824"),
        (["--gpus", "8", "--max-pp", "0"], "--max-pp must be at least 1"),
        (["--gpus", "8", "--max-tp", str(10**12)], "--max-tp must be at most 1048576"),
        (["--gpus", "8", "--top", "0"], "--top must be at least 1"),
        (["--gpus", "8", "--num-unique-layers", "0"], "--num-unique-layers must be at least 1"),
        (["--gpus", "8", "--assume", "mfu=nan"], "--assume 'mfu=nan': must be a positive finite number"),
        (["--gpus", "8", "--assume", "mfu=inf"], "--assume 'mfu=inf': must be a positive finite number"),
        (["--gpus", "8", "--assume", "mfu=-1"], "--assume 'mfu=-1': must be a positive finite number"),
        (["--gpus", "8", "--assume", "mfu=2"], "mfu must be positive and at most 1"),
        (["--gpus", "8", "--assume", "reserved_gpu_bytes=1e300"], "reserved_gpu_bytes must be at most"),
        (["--gpus", "8", "--assume", "peak_flops=1e40"], "peak_flops must be positive and at most 1e+30"),
        (["--gpus", "8", "--assume", "mfu"], "expected NAME=VALUE"),
    ],
)
def test_every_number_the_planner_takes_is_bounded(tmp_path, capsys, argv, message):
    _write(tmp_path / "config.json", TINY)
    code, out, err = _plan(capsys, "--config", str(tmp_path), *argv)
    assert code == 2 and out == ""
    _one_line(err, message)
    assert len(err) < 300


@pytest.mark.parametrize("size", ["0GB", "9" * 400 + "GB", "2EiB", "1" * 10_000, "1e9GB", "-1GB"])
def test_memory_sizes_are_bounded(size):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        parse_size(size)


def test_memory_size_units():
    assert (parse_size("80GB"), parse_size("1TiB"), parse_size(" 0.5 kib "), parse_size("1")) == (
        80 * 10**9,
        2**40,
        512,
        1,
    )


def test_divisors():
    for n in [*range(1, 300), 720720, 1 << 20]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("name", ["dense real", "dense pseudo", "moe real", "moe pseudo"])
def test_a_layouts_model_states_are_the_per_tensor_sums(name):
    """The planner counts each kind of block once per layout; the sums are `model_state_bytes` over every tensor
    the stage holds, whatever the offload, sharding and TP."""
    config = (moe_config if name.startswith("moe") else tiny_config)()
    pseudo, real = pseudo_and_real(config, 2)
    config = pseudo if name.endswith("pseudo") else real
    tensors, p = parameter_tensors(config), PRECISIONS["mixed"]
    layouts = candidate_layouts(config, 8, Hardware(), 8, 1) + candidate_layouts(config, 1, Hardware(), 8, 1)
    assert any(layout.offload not in (0, 1) for layout in layouts) and any(layout.tp > 1 for layout in layouts)
    for layout in layouts:
        (stage,) = pipeline_stages(config, 1)
        offloaded = set(stage.blocks[: round(layout.offload * len(stage.blocks))])
        expected = model_state_bytes(stage_tensors(tensors, stage, config.tie_word_embeddings), layout, p, offloaded)
        memory = estimate(config, layout, workload(), Hardware(), tensors).memory
        assert (memory.weights, memory.grads, memory.optimizer, memory.cpu) == (
            expected.weights,
            expected.grads,
            expected.optimizer,
            expected.cpu,
        ), layout


# Issue 24: the table says how to see the rows it leaves out.


def _rows(out: str) -> list[list[str]]:
    """The rank column of each table, one list per table."""
    tables = out.split(" model: ")[1:]
    return [re.findall(r"^\| (\d+) +\| dp", table, flags=re.MULTILINE) for table in tables]


def test_the_table_says_how_to_see_the_rest(tmp_path, capsys):
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path)
    argv = ["--config", str(tmp_path), "--gpus", "4", "--gpu-memory", "4GiB", "--seq-len", "32"]
    code, out, _ = _plan(capsys, *argv)
    total = int(re.search(r"pseudo model: .* of (\d+) fit", out)[1])
    assert code == 0 and total > 10 and [len(rows) for rows in _rows(out)] == [10, 10]
    assert f"10 of {total} layouts shown (fastest first): --top N shows N, --all shows every one" in out

    code, out, _ = _plan(capsys, *argv, "--all")
    assert code == 0 and [len(rows) for rows in _rows(out)] == [total, total] and "layouts shown" not in out
    code, out, _ = _plan(capsys, *argv, "--top", str(total))
    assert code == 0 and [len(rows) for rows in _rows(out)] == [total, total] and "layouts shown" not in out


def test_when_nothing_fits_the_closest_are_shown_and_the_rest_offered(tmp_path, capsys):
    tiny_config().save_pretrained(tmp_path)
    code, out, _ = _plan(capsys, "--config", str(tmp_path), "--gpus", "2", "--gpu-memory", "1GB")
    assert code == 0 and "; 0 of " in out and [len(rows) for rows in _rows(out)] == [3, 3]
    assert re.search(r"3 of \d+ layouts shown \(closest to fitting first\): --top N shows N, --all shows", out)


def test_help_names_the_row_flags():
    result = _run_plan("--help")
    assert result.returncode == 0 and "--all" in result.stdout and "--top N" in result.stdout


# Property tests: random and mutated inputs end in InputError (one line) or succeed; nothing else escapes.

_FIELDS = sorted({*TINY, "share_layers", "num_unique_layers", "sharing_pattern", "model_type", "head_dim"})
_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-5, 70)
    | st.sampled_from([2**24 + 1, 10**9, 2**63, -(2**63), 10**400])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["p2r", "p2r_moe", "llama", "cycle", "sequence", "silu"])
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def _mutated_configs(draw):
    config = dict(TINY)
    config["model_type"] = draw(st.sampled_from(["p2r", "p2r_moe", "llama"]))
    if config["model_type"] == "p2r_moe":
        config.update(num_experts=4, num_experts_per_tok=2)
    for _ in range(draw(st.integers(0, 4))):
        action = draw(st.sampled_from(["set", "delete", "add"]))
        if action == "delete" and config:
            config.pop(draw(st.sampled_from(sorted(config))))
        elif action == "set":
            config[draw(st.sampled_from(_FIELDS))] = draw(_JSON)
        else:
            config[draw(st.text(max_size=12))] = draw(_JSON)
    return config


def _check_one_line(error: Exception, file: Path) -> None:
    message = str(error)
    assert "\n" not in message and message.startswith(str(file)) and len(message) < 1000, message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=_mutated_configs(), as_folder=st.booleans())
def test_read_config_property(config, as_folder):
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / ("config.json" if as_folder else "c.json")
        file.write_text(json.dumps(config))
        try:
            found = read_config(file.parent if as_folder else file)
        except InputError as error:
            event("refused")
            _check_one_line(error, file)
            return
    event("read")
    assert found.config.num_hidden_layers >= 1 and found.config.hidden_size >= 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=_mutated_configs())
def test_plan_command_property(config):
    """End to end: exit 0 with both tables, or exit 2 with one line; never a traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        file = _write(Path(tmp) / "c.json", config)
        code, out, err = _plan_quietly("--config", str(file), "--gpus", "4", "--max-pp", "4", "--seq-len", "16")
    event(f"exit {code}")
    assert (code, err.count("\n"), out.count(" model: ")) in ((0, 0, 2), (2, 1, 0)), (code, err)
    assert code == 0 or err.startswith("hf-p2r plan: error: ")


def _plan_quietly(*argv) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


_NAMES = [f.name for f in Hardware.__dataclass_fields__.values()] + ["", "speed", "mfu "]
_NUMBERS = st.floats() | st.integers(-(10**40), 10**40) | st.sampled_from(["nan", "-inf", "1e999", "0x10", "1_0", ""])


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(st.sampled_from(_NAMES) | st.text(max_size=8), _NUMBERS | st.text(max_size=8)), max_size=4)
)
def test_assume_property(items):
    try:
        hardware = Hardware(**_assumptions([f"{name}={value}" for name, value in items]))
    except InputError as error:
        assert "\n" not in str(error) and len(str(error)) < 400
        return
    for name in ("peak_flops", "mfu", "intra_node_bandwidth", "pcie_bandwidth", "cpu_adam_params_per_second"):
        assert 0 < getattr(hardware, name) < math.inf
    assert 0 <= hardware.reserved_gpu_bytes <= MAX_MEMORY


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=30)
    | st.from_regex(r"\s*[0-9]{0,30}\.?[0-9]{1,30}\s*[KMGTkmgt]?[iI]?[bB]?\s*", fullmatch=True)
)
def test_parse_size_property(text):
    try:
        size = parse_size(text)
    except argparse.ArgumentTypeError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(size, int) and 1 <= size <= MAX_MEMORY


@settings(max_examples=200, deadline=None)
@given(value=st.integers() | st.floats() | st.booleans() | st.none() | st.text(max_size=5))
def test_check_int_property(value):
    try:
        assert check_int("--gpus", value, 1, 1 << 20) == value and 1 <= value <= 1 << 20
    except InputError as error:
        assert str(error).startswith("--gpus must be ") and len(str(error)) < 100
