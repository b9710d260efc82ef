"""hf_p2r.errors: the one bad-input type, the exit-code rule, the JSON reader every tool reads files with, and how names
from disk are shown (`printable`; the token's redaction: tests/security/test_token.py)."""

import json
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_p2r.errors import InputError, exit_code, parse_json, printable, read_json


def test_exit_code_is_2_for_bad_input_and_1_for_failures_at_run_time():
    assert [exit_code(e) for e in (InputError("x"), ValueError("x"), KeyError("x"))] == [2, 2, 2]
    assert exit_code(FileNotFoundError(2, "No such file")) == 2
    assert exit_code(FileExistsError(17, "exists")) == 2
    assert exit_code(OSError(28, "No space left on device")) == 1
    assert exit_code(RuntimeError("non-finite loss")) == 1


@pytest.mark.parametrize("depth", [10_000, 1_000_000])
def test_deeply_nested_json_is_one_input_error(tmp_path, depth):
    path = tmp_path / "config.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(InputError, match=r"config\.json: not valid JSON \(nested too deeply\)"):
        read_json(path, expect=None)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got array"),
        (b"null", "expected a JSON object, got null"),
    ],
)
def test_malformed_or_mistyped_documents_name_the_file(tmp_path, data, message):
    path = tmp_path / "trainer_state.json"
    path.write_bytes(data)
    with pytest.raises(InputError, match=message) as caught:
        read_json(path)
    assert str(caught.value).startswith(f"{path}: ") and "\n" not in str(caught.value)


def test_oversized_document_is_refused_before_parsing(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {"x" * 100: "a"}}))
    with pytest.raises(InputError, match="too large"):
        read_json(path, max_bytes=64)


def test_a_fifo_a_folder_and_a_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(InputError, read_json, fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert done and "a FIFO" in str(done[0].value)
    with pytest.raises(InputError, match="a folder"):
        read_json(tmp_path)
    with pytest.raises(InputError, match="a character device"):
        read_json("/dev/zero")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_json(tmp_path / "missing.json")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_parse_or_raise_input_error(data):
    try:
        parse_json(data, "x.json")
    except InputError as error:
        assert str(error).startswith("x.json: not valid JSON") and "\n" not in str(error)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
        max_leaves=30,
    )
)
def test_well_formed_documents_round_trip(value):
    assert parse_json(json.dumps(value), "x.json") == value


# Issue 36: names from disk are shown with their control characters escaped (one helper, used everywhere).
@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("model.safetensors", "model.safetensors"),
        ("a\nforged: line", "a\\nforged: line"),
        ("bell\x07 esc\x1b[2J tab\t", "bell\\x07 esc\\x1b[2J tab\\t"),
        ("é ü 模型", "é ü 模型"),
        ("\u202eRTL override", "\\u202eRTL override"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(name, shown):
    assert printable(name) == shown


@settings(max_examples=200, deadline=None)
@given(st.text(), st.none() | st.integers(3, 50))
def test_printable_is_one_printable_line_that_keeps_printable_text(text, limit):
    shown = printable(text, limit)
    assert shown.isprintable() and "\n" not in shown
    assert limit is None or len(shown) <= limit
    if text.isprintable() and limit is None:
        assert shown == text
    assert printable(shown) == shown, "idempotent: an escaped name is not escaped twice"
