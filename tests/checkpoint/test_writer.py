import errno
import json

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hf_p2r.checkpoint import CheckpointReader, write_checkpoint
from hf_p2r.checkpoint import writer as writer_module


@pytest.fixture
def spy(monkeypatch):
    """Records the TensorSpecs of every serialize_file call (pointers included), then writes for real."""
    calls = []
    real = writer_module.serialize_file

    def recording(specs, path, metadata=None):
        calls.append({name: spec.data_ptr for name, spec in specs.items()})
        return real(specs, path, metadata=metadata)

    monkeypatch.setattr(writer_module, "serialize_file", recording)
    return calls


def test_small_checkpoint_is_one_file(tmp_path):
    tensors = {"w": torch.randn(4, 4), "n": torch.arange(3)}
    assert write_checkpoint(tmp_path, tensors) == [tmp_path / "model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_checkpoint_with_index(tmp_path):
    tensors = {f"layer.{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    files = write_checkpoint(tmp_path, tensors, max_shard_size=800, metadata={"origin": "test"})
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [f.name for f in files] == [*shards, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 2000, "total_parameters": 500}
    assert index["weight_map"] == {f"layer.{i}": shards[i // 2] for i in range(5)}
    with CheckpointReader(tmp_path) as reader:
        assert all(torch.equal(reader.get(name), tensors[name]) for name in tensors)
    with safe_open(tmp_path / shards[0], "pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "test"}


def test_repeated_tensor_is_written_from_its_own_memory(tmp_path, spy):
    save_file({"block": torch.randn(8, 8)}, tmp_path / "src.safetensors")
    with safe_open(tmp_path / "src.safetensors", "pt") as f:
        block = f.get_tensor("block")  # memory-mapped
        out = tmp_path / "out"
        out.mkdir()
        write_checkpoint(out, {f"layers.{i}.w": block for i in range(6)}, max_shard_size=600)
    assert len(spy) == 3, "two copies per shard"
    assert {ptr for call in spy for ptr in call.values()} == {block.data_ptr()}, "no copy: pointers into the mmap"
    written = load_file(out / "model-00003-of-00003.safetensors")
    assert torch.equal(written["layers.5.w"], block)


def test_dtype_cast_and_non_contiguous_tensors_are_staged_once_per_shard(tmp_path, spy):
    source = torch.randn(6, 4, dtype=torch.float64)
    tensors = {
        "a.cast": source,
        "b.cast_again": source,  # same source, same dtype: staged once
        "c.transposed": source.t(),  # non-contiguous: staged
        "d.ints": torch.arange(5),  # not floating point: written as is
    }
    write_checkpoint(tmp_path, tensors, dtype=torch.bfloat16)
    (call,) = spy
    assert call["a.cast"] == call["b.cast_again"] != source.data_ptr()
    assert call["c.transposed"] not in (source.data_ptr(), call["a.cast"])
    assert call["d.ints"] == tensors["d.ints"].data_ptr()
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["a.cast"], source.to(torch.bfloat16))
    assert torch.equal(loaded["c.transposed"], source.t().to(torch.bfloat16))
    assert loaded["d.ints"].dtype == torch.int64 and torch.equal(loaded["d.ints"], torch.arange(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"], "the scratch file is gone"


def test_disk_errors_become_os_errors_naming_the_file(tmp_path, monkeypatch):
    def full(specs, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(writer_module, "serialize_file", full)
    with pytest.raises(OSError, match="No space left on device: .*model.safetensors") as info:
        write_checkpoint(tmp_path, {"w": torch.zeros(3)})
    assert info.value.errno == errno.ENOSPC


def test_concurrent_shards_are_identical_to_sequential_ones(tmp_path):
    tensors = {f"layer.{i}": torch.randn(50) for i in range(9)}
    for workers in (1, 3):
        (tmp_path / str(workers)).mkdir()
        write_checkpoint(tmp_path / str(workers), tensors, max_shard_size=450, workers=workers)
    files = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert len(files) == 6 and files == sorted(p.name for p in (tmp_path / "3").iterdir())
    assert all((tmp_path / "1" / f).read_bytes() == (tmp_path / "3" / f).read_bytes() for f in files)
