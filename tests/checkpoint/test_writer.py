import ctypes
import errno
import json
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_p2r.checkpoint import CheckpointReader, write_checkpoint
from hf_p2r.checkpoint import writer as writer_module
from hf_p2r.checkpoint.ranges import Stopped


@pytest.fixture
def spy(monkeypatch):
    """Records where every tensor byte written comes from: ("memory", address, bytes) for a write from memory,
    ("kernel", offset in the file, bytes) for a copy within the file; then writes for real."""
    calls = []
    real_write, real_copy = writer_module.write_all, writer_module.copy_range

    def write_all(fd, data, offset, path=None):
        if not isinstance(data, bytes):  # the header is bytes; tensors are written from memory (a ctypes array)
            calls.append(("memory", ctypes.addressof(data), len(data)))
        return real_write(fd, data, offset, path)

    def copy_range(source, offset, out, out_offset, nbytes, **kwargs):
        calls.append(("kernel", offset, nbytes))
        return real_copy(source, offset, out, out_offset, nbytes, **kwargs)

    monkeypatch.setattr(writer_module, "write_all", write_all)
    monkeypatch.setattr(writer_module, "copy_range", copy_range)
    return calls


def _within(address, tensor):
    return tensor.data_ptr() <= address < tensor.data_ptr() + tensor.numel() * tensor.element_size()


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
        write_checkpoint(out, {f"layers.{i}.w": block for i in range(6)}, max_shard_size=600, workers=1)
    # two copies per shard: the first from the mmap (no copy in this process), the second by the kernel from the first
    assert [kind for kind, _, _ in spy] == ["memory", "kernel"] * 3
    assert all(_within(address, block) for kind, address, _ in spy if kind == "memory"), "pointers into the mmap"
    written = load_file(out / "model-00003-of-00003.safetensors")
    assert torch.equal(written["layers.5.w"], block)


def test_dtype_cast_and_non_contiguous_tensors_are_converted_once_per_shard(tmp_path, spy):
    source = torch.randn(6, 4, dtype=torch.float64)
    tensors = {
        "a.cast": source,
        "b.cast_again": source,  # same source, same dtype: converted once, then copied within the file
        "c.transposed": source.t(),  # non-contiguous: converted through the buffer
        "d.ints": torch.arange(5),  # not floating point: written as is, from its own memory
    }
    write_checkpoint(tmp_path, tensors, dtype=torch.bfloat16)
    kinds = [(kind, _within(address, source), _within(address, tensors["d.ints"])) for kind, address, _ in spy]
    # the file's order: int64 before bfloat16 (safetensors orders by dtype), then by name
    assert kinds == [
        ("memory", False, True),
        ("memory", False, False),
        ("kernel", False, False),
        ("memory", False, False),
    ]
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["a.cast"], source.to(torch.bfloat16))
    assert torch.equal(loaded["b.cast_again"], source.to(torch.bfloat16))
    assert torch.equal(loaded["c.transposed"], source.t().to(torch.bfloat16))
    assert loaded["d.ints"].dtype == torch.int64 and torch.equal(loaded["d.ints"], torch.arange(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"], "nothing else is written"


TENSORS = {
    "f32": torch.randn(3, 5),
    "bf16": torch.randn(7, dtype=torch.bfloat16),
    "f16": torch.randn(2, 2, 2, dtype=torch.float16),
    "f64 scalar": torch.tensor(1.5, dtype=torch.float64),
    "empty": torch.zeros(0, 4),
    "int8": torch.arange(-5, 5, dtype=torch.int8),
    "bool": torch.tensor([True, False, True]),
    "é unicode": torch.ones(2),
    "transposed": torch.randn(5, 3).t(),
    "sliced": torch.randn(6, 6)[1:5, ::2],
    "long": torch.randn(1000),  # many pieces when pieces are small
}


@pytest.mark.parametrize("piece", [16 << 20, 64], ids=["one piece", "many pieces"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64], ids=["kept", "bfloat16", "float64"])
def test_files_are_byte_identical_to_what_safetensors_writes(tmp_path, monkeypatch, piece, dtype):
    monkeypatch.setattr(writer_module, "_PIECE", piece)
    write_checkpoint(tmp_path, TENSORS, dtype=dtype, progress=False)
    expected = {
        name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t) for name, t in TENSORS.items()
    }
    save_file(
        {name: t.contiguous() for name, t in expected.items()}, tmp_path / "reference.safetensors", {"format": "pt"}
    )
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    permutation=st.randoms(use_true_random=False),
    limit=st.integers(1, 40),
    step=st.integers(1, 2),
)
def test_pieces_cover_any_view_in_row_major_order(shape, permutation, limit, step):
    """`_pieces` of any view (permuted, strided) are, back to back, its elements in row-major order."""
    base = torch.arange(max(1, math.prod(shape)) * step ** len(shape) * 2).float()
    tensor = base[: math.prod(s * step for s in shape)].view([s * step for s in shape]) if shape else base[0]
    tensor = tensor[tuple(slice(None, None, step) for _ in shape)]
    order = list(range(len(shape)))
    permutation.shuffle(order)
    tensor = tensor.permute(order)
    pieces = list(writer_module._pieces(tensor, limit))
    assert all(piece.numel() <= max(limit, 1) for piece in pieces)
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.zeros(0), tensor.reshape(-1))


def test_a_full_disk_is_an_os_error_naming_the_file_before_any_write(tmp_path, monkeypatch, spy):
    def full(fd, offset, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "allocate", full)
    with pytest.raises(OSError, match="No space left on device: .*model.safetensors") as info:
        write_checkpoint(tmp_path, {"w": torch.zeros(3)}, dtype=torch.float16)
    assert info.value.errno == errno.ENOSPC and spy == [], "nothing written"


def test_disk_errors_while_writing_become_os_errors_naming_the_file(tmp_path, monkeypatch):
    """Where the filesystem cannot allocate ahead (fallocate unsupported), the write itself fails: same error."""

    def full(fd, data, offset, path=None):
        if not isinstance(data, bytes):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "write_all", full)
    with pytest.raises(OSError, match="No space left on device: .*model.safetensors") as info:
        write_checkpoint(tmp_path, {"w": torch.zeros(3)}, dtype=torch.float16)
    assert info.value.errno == errno.ENOSPC


def test_a_stop_ends_a_write_between_two_pieces(tmp_path, monkeypatch):
    """The stop event (another shard failed, Ctrl-C) is seen between two pieces of one tensor, not at its end."""
    monkeypatch.setattr(writer_module, "_PIECE", 64)
    stop, written = threading.Event(), []
    real = writer_module.write_all

    def write_all(fd, data, offset, path=None):
        real(fd, data, offset, path)
        if not isinstance(data, bytes):
            written.append(offset)
            stop.set()  # after the first piece

    monkeypatch.setattr(writer_module, "write_all", write_all)
    for tensor, dtype in ((torch.randn(100), torch.float32), (torch.randn(100), torch.float16)):  # as is / converted
        written.clear(), stop.clear()
        path = tmp_path / f"{dtype}.safetensors"
        with pytest.raises(Stopped):
            writer_module.write_file(path, {"w": tensor}, {"w": dtype}, {"format": "pt"}, stop=stop)
        assert len(written) == 1, "one piece of several"


def test_concurrent_shards_are_identical_to_sequential_ones(tmp_path):
    tensors = {f"layer.{i}": torch.randn(50) for i in range(9)}
    for workers in (1, 3):
        (tmp_path / str(workers)).mkdir()
        write_checkpoint(tmp_path / str(workers), tensors, max_shard_size=450, workers=workers)
    files = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert len(files) == 6 and files == sorted(p.name for p in (tmp_path / "3").iterdir())
    assert all((tmp_path / "1" / f).read_bytes() == (tmp_path / "3" / f).read_bytes() for f in files)
