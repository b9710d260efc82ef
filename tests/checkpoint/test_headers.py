"""The safetensors headers and the shard index, read from files hf-p2r did not write: whatever they hold (random bytes,
mutated headers, FIFOs, devices, links out of the folder), the readers succeed or raise one line naming the file."""

import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from hf_p2r.checkpoint.headers import INDEX_NAME, read_header, read_weights

# What the readers may raise: bad input (ValueError, InputError among them) or a missing file. Nothing else.
EXPECTED = (ValueError, FileNotFoundError)
_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_file(path):
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, path, {"format": "pt"})
    return path.read_bytes()


def _one_line(error: BaseException, path) -> None:
    message = str(error)
    assert "\n" not in message and len(message) < 2000, message
    assert str(path) in message, message


def _check(path):
    """read_header(path) succeeds with consistent tensors, or fails with one line naming the file."""
    try:
        tensors = read_header(path)
    except EXPECTED as error:
        _one_line(error, path)
        return
    size = path.stat().st_size
    assert all(0 <= info.offset and info.offset + info.nbytes <= size for info in tensors.values())


@_SETTINGS
@given(data=st.binary(max_size=200))
def test_random_bytes(tmp_path, data):
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    _check(path)


@_SETTINGS
@given(data=st.data())
def test_mutated_files(tmp_path, data):
    """A valid file with bytes flipped, inserted, deleted or cut anywhere (header length, header, data)."""
    path = tmp_path / "model.safetensors"
    raw = bytearray(_valid_file(path))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        how = data.draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if how == "flip" and at < len(raw):
            raw[at] = data.draw(st.integers(0, 255))
        elif how == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif how == "delete":
            del raw[at : at + data.draw(st.integers(1, 8))]
        else:
            del raw[at:]
    path.write_bytes(bytes(raw))
    _check(path)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "I64", "BOOL", "F8_E4M3", "X", ""]) | _JSON,
        "shape": st.lists(st.integers(-2, 5) | st.booleans(), max_size=3) | _JSON,
        "data_offsets": st.lists(st.integers(-2, 64) | st.booleans(), max_size=3) | _JSON,
    },
)


@_SETTINGS
@given(
    header=st.dictionaries(st.text(max_size=6), _ENTRY | _JSON, max_size=4),
    metadata=st.none() | _JSON,
    body=st.binary(max_size=96),
)
def test_random_headers(tmp_path, header, metadata, body):
    """Well-formed JSON with random entries (wrong types, negative or boolean sizes, lying offsets, bad metadata)."""
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    _check(path)


def test_a_deeply_nested_header_is_one_line(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = b"[" * 200_000
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(
        ValueError, match="model.safetensors: not a valid safetensors file: its header is not valid JSON"
    ):
        read_header(path)


def test_a_boolean_is_not_a_size(tmp_path):
    """JSON's true is not 1: safetensors refuses it, so must we (Python's bool is an int)."""
    path = tmp_path / "model.safetensors"
    raw = json.dumps({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, True]}}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(ValueError, match="tensor 'a': expected a dtype, a shape and data_offsets"):
        read_header(path)


# --- the index ---------------------------------------------------------------------------------------------------


@_SETTINGS
@given(index=_JSON, text=st.none() | st.text(max_size=40))
def test_random_indexes(tmp_path, index, text):
    """Any index.json (random JSON or text) beside a valid shard: read, or one line naming a file of the folder."""
    _valid_file(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps(index) if text is None else text)
    try:
        read_weights(tmp_path)
    except EXPECTED as error:
        _one_line(error, tmp_path)


@_SETTINGS
@given(weight_map=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["s1", "s2", "s1/x", ".."])))
def test_random_weight_maps(tmp_path, weight_map):
    """Weight maps naming present, missing, nested or parent shards, listing too many tensors or too few."""
    for name in ("s1", "s2"):
        _valid_file(tmp_path / name)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    try:
        tensors = read_weights(tmp_path)
    except EXPECTED as error:
        _one_line(error, tmp_path)
        return
    assert set(tensors) == set(weight_map)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: os.mkfifo(p), "which is a FIFO$"),
        (lambda p: p.symlink_to("/dev/zero"), "which is a link to a character device \\(/dev/zero\\)"),
        (lambda p: p.symlink_to(p.parent.parent / "outside.safetensors"), "which is a link out of"),
    ],
    ids=["fifo", "/dev/zero", "out of the folder"],
)
def test_a_shard_that_is_not_a_file_within_the_folder(tmp_path, make, message):
    """Once "names shard X, which does not exist" for a FIFO that exists: the message now says what X is."""
    folder = tmp_path / "model"
    folder.mkdir()
    _valid_file(tmp_path / "outside.safetensors")
    _valid_file(folder / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    make(folder / "model-00001-of-00002.safetensors")
    with pytest.raises(
        ValueError, match=f"{INDEX_NAME}: names shard model-00001-of-00002.safetensors, {message}"
    ) as info:
        read_weights(folder)
    assert "\n" not in str(info.value)


def test_read_header_of_a_fifo_or_a_device_does_not_open_it(tmp_path):
    """Once "the file has 0 bytes" (a FIFO or /dev/zero is not a file); opening a FIFO would block."""
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a valid safetensors file: a FIFO, not a regular file"):
        read_header(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="^/dev/zero: not a valid safetensors file: a character device, not a regular"):
        read_header("/dev/zero")


def test_a_hub_cache_snapshot_is_read_through_its_links(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    _valid_file(repo / "blobs" / "1234")
    (repo / "snapshots" / "abc" / "model.safetensors").symlink_to("../../blobs/1234")
    assert sorted(read_weights(repo / "snapshots" / "abc")) == ["a", "b"]
