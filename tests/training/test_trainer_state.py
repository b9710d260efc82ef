"""trainer_state.json, however damaged: random and mutated documents end in one `InputError` line naming the file, or
read as a valid state; nothing else escapes (property-based, with a bounded budget per test)."""

import copy
import dataclasses
import json
import math
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_p2r.errors import InputError
from hf_p2r.training import parse_config
from hf_p2r.training.checkpointing import STATE_FILE, TrainState, read_state, read_trainer_state

from .helpers import tiny_argv

CONFIG = parse_config(tiny_argv("unused", pseudo_steps=2, real_steps=2))
VALID = {
    "stage": "pseudo",
    "state": dataclasses.asdict(
        TrainState(step=2, num_blocks=1, blocks_consumed=8, train_time_s=0.5, metrics_records=5)
    ),
    "config": CONFIG.to_dict(),
}
BUDGET = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)


@contextmanager
def _checkpoint(document: bytes | str):
    """A checkpoint folder whose trainer_state.json holds `document`."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / STATE_FILE).write_bytes(document if isinstance(document, bytes) else document.encode())
        yield folder


def _read(document: bytes | str):
    """read_state over a checkpoint holding `document`: a TrainState, or the InputError's line (checked: one line,
    naming the file or the checkpoint)."""
    with _checkpoint(document) as folder:
        try:
            return read_state(folder, CONFIG)
        except InputError as error:
            message = str(error)
            named = str(folder / STATE_FILE) in message or f"resume_from_checkpoint: {folder} " in message
            assert named and "\n" not in message, message
            return message


def _check_state(state: TrainState) -> None:
    for field in dataclasses.fields(TrainState):
        value = getattr(state, field.name)
        assert type(value) is field.type, (field.name, value)
        assert field.type is not float or math.isfinite(value)


def test_the_valid_document_reads_back():
    assert _read(json.dumps(VALID)) == TrainState(**VALID["state"])


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("", r"not valid JSON"),
        ("[]", r"expected a JSON object, got array"),
        ("[" * 100_000, r"not valid JSON \(nested too deeply\)"),
        (b"\xff\xfe{", r"not valid JSON"),
        (json.dumps({**VALID, "state": []}), r'"state" is a JSON array, expected a JSON object'),
        (json.dumps({k: v for k, v in VALID.items() if k != "config"}), r'"config" missing'),
        (json.dumps({**VALID, "state": {**VALID["state"], "step": True}}), r'"state\.step" is true, expected an int'),
        (json.dumps({**VALID, "state": {**VALID["state"], "step": 2.0}}), r'"state\.step" is 2\.0, expected an int'),
        (json.dumps({**VALID, "state": {**VALID["state"], "num_blocks": 0}}), r'"state\.num_blocks" is 0, expected'),
        (json.dumps({**VALID, "state": {**VALID["state"], "train_time_s": -1}}), r'"state\.train_time_s" is -1'),
        (json.dumps({**VALID, "stage": "real"}), r'stage "real" does not match num_blocks 1 of 4 layers'),
        (json.dumps({**VALID, "config": {**VALID["config"], "hidden_size": 64}}), r"comes from a different run"),
    ],
)
def test_each_kind_of_damage_is_one_line_naming_the_file(document, message):
    result = _read(document)
    assert isinstance(result, str) and re.search(message, result), result


def test_infinity_is_refused():
    document = json.dumps({**VALID, "state": {**VALID["state"], "log_loss_sum": math.inf}})  # json writes Infinity
    assert '"state.log_loss_sum" is Infinity, expected a finite number' in _read(document)


@BUDGET
@given(st.binary(max_size=64))
def test_random_bytes(document):
    assert isinstance(_read(document), str)


@BUDGET
@given(json_values)
def test_random_json(value):
    result = _read(json.dumps(value))
    assert isinstance(result, str)  # a random document is never a whole state


def _paths(value, prefix=()):
    """Every key path into nested dicts and lists."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


PATHS = [path for path in _paths(VALID) if path]


@st.composite
def mutated(draw):
    """VALID with one to three edits: a key dropped, a key added, or a value replaced by any JSON value."""
    document = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = document
        try:
            for key in path[:-1]:
                parent = parent[key]
            kind = draw(st.sampled_from(["drop", "add", "replace"]))
            if kind == "drop" and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif kind == "add" and isinstance(parent, dict):
                parent[draw(st.text(max_size=8))] = draw(json_values)
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced the way there
            continue
    return document


@BUDGET
@given(mutated())
def test_mutated_documents(document):
    result = _read(json.dumps(document))
    if isinstance(result, TrainState):
        _check_state(result)
        assert document["state"] == {k: getattr(result, k) for k in document["state"]}


@BUDGET
@given(mutated())
def test_read_trainer_state_returns_checked_fields_or_one_line(document):
    with _checkpoint(json.dumps(document)) as folder:
        try:
            state, stage, saved = read_trainer_state(folder / STATE_FILE)
        except InputError as error:
            assert str(error).startswith(str(folder / STATE_FILE)) and "\n" not in str(error)
            return
    _check_state(state)
    assert stage in (None, "pseudo", "real") and isinstance(saved, dict)
