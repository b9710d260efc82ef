import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from hf_p2r.checkpoint import CheckpointReader, write_checkpoint

TENSORS = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}


def _header(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _rewrite_header(path, header, body):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


@pytest.fixture
def single(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.fixture
def sharded(tmp_path):
    write_checkpoint(tmp_path, {f"t{i}": torch.full((64,), float(i)) for i in range(4)}, max_shard_size=600)
    return tmp_path


def test_reads_single_file_memory_mapped(single):
    with CheckpointReader(single) as reader:
        assert reader.keys() == ["a", "b"] and len(reader) == 2 and "a" in reader
        assert reader.file_of("a") == single / "model.safetensors"
        assert all(torch.equal(reader.get(name), TENSORS[name]) for name in TENSORS)
        # memory-mapped: every read of a tensor points at the same file pages, no copy
        assert reader.get("a").data_ptr() == reader.get("a").data_ptr()


def test_reads_sharded_checkpoint(sharded):
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    with CheckpointReader(sharded) as reader:
        assert reader.keys() == ["t0", "t1", "t2", "t3"]
        assert len({reader.file_of(name) for name in reader.keys()}) > 1
        assert all(torch.equal(reader.get(f"t{i}"), torch.full((64,), float(i))) for i in range(4))


def test_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no model.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin: only safetensors"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda data: data[:-10], "header describes 88 bytes of tensor data but the file holds 78: truncated"),
        (lambda data: data[:20], "runs past the end of the file"),
        (lambda data: b"", "the file has 0 bytes"),
        (lambda data: data[:8] + b"{not json" + data[17:], "header is not valid JSON"),
        (lambda data: data + b"\0" * 8, "8 bytes after the last tensor"),
    ],
    ids=["truncated-data", "truncated-header", "empty", "corrupt-header", "trailing-bytes"],
)
def test_damaged_file_names_file_and_problem(single, damage, problem):
    path = single / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=f"{path}: not a valid safetensors file: .*{problem}"):
        CheckpointReader(single)


def test_lying_header_offsets_past_end_of_file(single):
    path = single / "model.safetensors"
    header, body = _header(path)
    header["b"]["data_offsets"] = [48, 48 + 40 + 800]
    header["b"]["shape"] = [105]
    _rewrite_header(path, header, body)
    with pytest.raises(ValueError, match="describes 888 bytes of tensor data but the file holds 88"):
        CheckpointReader(single)


def test_lying_header_shape_does_not_match_byte_length(single):
    path = single / "model.safetensors"
    header, body = _header(path)
    header["a"]["shape"] = [4, 4]
    _rewrite_header(path, header, body)
    with pytest.raises(ValueError, match=r"tensor 'a': shape \[4, 4\] of F32 needs 64 bytes but .* hold 48"):
        CheckpointReader(single)


def test_index_naming_a_missing_shard(sharded):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="index.json: names shard model-00002-of-00002.safetensors, which does"):
        CheckpointReader(sharded)


def test_index_naming_a_missing_tensor(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match="index.json: lists ghost in model-00001-of-00002.safetensors, but .* does not"
    ):
        CheckpointReader(sharded)


def test_shard_holding_tensors_the_index_does_not_list(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["t0"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors: holds t0, which model.safetensors.index"):
        CheckpointReader(sharded)


@pytest.mark.parametrize("text", ["not json", '{"metadata": {}}', '{"weight_map": {"a": "../x.safetensors"}}'])
def test_malformed_index(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match="model.safetensors.index.json: "):
        CheckpointReader(tmp_path)
