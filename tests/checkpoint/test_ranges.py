"""The torch-free conversion: headers built as safetensors builds them, shards copied as byte ranges by the kernel, the
plan (names, shapes, delink map) the same as the model's."""

import errno
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_p2r import P2RForCausalLM, convert_pseudo_to_real
from hf_p2r.checkpoint import CheckpointReader, save_model, write_checkpoint
from hf_p2r.checkpoint import ranges as ranges_module
from hf_p2r.checkpoint.convert import output_config
from hf_p2r.checkpoint.headers import build_header, read_weights
from hf_p2r.checkpoint.source import parameter_shapes, read_p2r_config_dict
from hf_p2r.models.p2r.sharing_p2r import delink_names, delink_sources

from ..conftest import tiny_config, tiny_model

CONFIGS = {
    "plain": dict(share_layers=True, num_unique_layers=2),
    "tied, biases, head_dim": dict(
        share_layers=True,
        num_unique_layers=1,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=16,
    ),
    "sequence, MHA": dict(share_layers=True, num_unique_layers=4, sharing_pattern="sequence", num_key_value_heads=4),
}


@pytest.mark.parametrize("fields", CONFIGS.values(), ids=CONFIGS)
def test_parameter_shapes_and_delink_map_agree_with_the_model(fields):
    """The converter plans without the model: its names, shapes and order, and its delink map, are the model's."""
    config = tiny_config(**fields)
    with torch.device("meta"):
        model = P2RForCausalLM(config)
    stored = {n: tuple(p.shape) for n, p in model.state_dict().items() if n not in model.all_tied_weights_keys}
    as_json = json.loads(config.to_json_string())
    k = config.num_unique_layers
    assert list(parameter_shapes(as_json, k).items()) == list(stored.items())
    for new_k in (None, 4) if k <= 2 else (None,):
        sources = delink_sources(8, k, new_k or 8, config.sharing_pattern)
        assert delink_names(parameter_shapes(as_json, k), sources) == model.delink_parameter_map(new_k)
        with torch.device("meta"):
            delinked = P2RForCausalLM(tiny_config(**fields)).delink(new_k)
        shapes = {n: tuple(p.shape) for n, p in delinked.state_dict().items() if n not in model.all_tied_weights_keys}
        assert list(parameter_shapes(as_json, new_k or 8).items()) == list(shapes.items())


def test_header_is_the_one_safetensors_writes(tmp_path):
    tensors = {
        "b": torch.zeros(2, 3),
        "a": torch.zeros(4, dtype=torch.bfloat16),
        "é": torch.zeros(1, dtype=torch.float16),
        "z": torch.tensor(1.0, dtype=torch.float64),
        "n": torch.zeros(0, dtype=torch.int8),
        "m": torch.zeros(3, 5, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    codes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int8": "I8"}
    specs = {name: (codes[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for name, t in tensors.items()}
    header, offsets = build_header(specs, {"format": "pt"})
    assert (tmp_path / "model.safetensors").read_bytes().startswith(header)
    assert offsets == {name: info.offset for name, info in read_weights(tmp_path).items()}


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"])
@pytest.mark.parametrize("fields", CONFIGS.values(), ids=CONFIGS)
def test_output_is_byte_identical_to_what_safetensors_writes(tmp_path, fields, shard_size):
    """The copied checkpoint is, file for file, what the torch path (`write_checkpoint`: safetensors' serializer over
    the delinked tensors) writes, and config.json is what transformers writes for the delinked model's config."""
    model = tiny_model(**fields)
    model.save_pretrained(tmp_path / "pseudo")
    out = convert_pseudo_to_real(tmp_path / "pseudo", tmp_path / "out", max_shard_size=shard_size, progress=False)
    real = model.delink()
    save_model(real, tmp_path / "reference", max_shard_size=shard_size, progress=False)
    weights = sorted(p.name for p in (tmp_path / "reference").glob("model*"))
    assert weights == sorted(p.name for p in out.glob("model*"))
    for name in weights:
        assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name
    assert (out / "config.json").read_text() == (tmp_path / "reference" / "config.json").read_text()
    # and both readers agree on it
    loaded = P2RForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in real.state_dict().items())
    if shard_size == "5GB":
        assert all(torch.equal(t, real.state_dict()[n]) for n, t in load_file(out / "model.safetensors").items())


def test_llama_config_is_what_transformers_writes(tmp_path):
    from transformers import LlamaConfig

    from hf_p2r import llama_config

    model = tiny_model(share_layers=True, num_unique_layers=2)
    model.save_pretrained(tmp_path / "pseudo")
    written = output_config(read_p2r_config_dict(tmp_path / "pseudo"), 8, target="llama", dtype="float32")
    llama_config(model.delink().config).save_pretrained(tmp_path / "reference")
    assert json.dumps(written, indent=2, sort_keys=True) + "\n" == (tmp_path / "reference" / "config.json").read_text()
    assert isinstance(LlamaConfig.from_dict(written), LlamaConfig)


def _files(tmp_path, data: bytes):
    (tmp_path / "src").write_bytes(data)
    source = os.open(tmp_path / "src", os.O_RDONLY)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o644)
    return source, out


@pytest.mark.parametrize(("offset", "out_offset", "nbytes"), [(0, 0, 10_000), (4096 + 8, 8, 20_000), (3, 5, 9000)])
def test_copy_range_clones_the_aligned_middle_and_copies_the_rest(tmp_path, monkeypatch, offset, out_offset, nbytes):
    """FICLONERANGE gets the whole blocks where source and output offsets line up; copy_file_range the rest. (The
    ioctl is simulated: this filesystem may have no reflinks.)"""
    data = os.urandom(40_000)
    source, out = _files(tmp_path, data)
    clones, block = [], os.fstat(out).st_blksize

    def fake_ioctl(fd, request, arg):
        src_fd, src_offset, length, dst_offset = struct.unpack("qQQQ", arg)
        clones.append((src_offset, length, dst_offset))
        os.pwrite(fd, os.pread(src_fd, length, src_offset), dst_offset)

    monkeypatch.setattr(ranges_module.fcntl, "ioctl", fake_ioctl)
    try:
        ranges_module.copy_range(source, offset, out, out_offset, nbytes)
    finally:
        os.close(source), os.close(out)
    assert (tmp_path / "out").read_bytes()[out_offset:] == data[offset : offset + nbytes]
    if (offset - out_offset) % block:
        assert clones == [], "offsets that do not line up are copied"
    else:
        ((src_offset, length, dst_offset),) = clones
        assert dst_offset % block == 0 and length % block == 0 and src_offset - dst_offset == offset - out_offset
        assert nbytes - length < 2 * block


@pytest.mark.parametrize("refused", ["reflink", "copy_file_range"])
def test_copy_range_falls_back_when_the_kernel_refuses(tmp_path, monkeypatch, refused):
    data = os.urandom(3 * 4096 + 100)
    source, out = _files(tmp_path, data)

    def refuse(*args):
        raise OSError(errno.EOPNOTSUPP if refused == "reflink" else errno.EXDEV, "refused")

    if refused == "reflink":
        monkeypatch.setattr(ranges_module.fcntl, "ioctl", refuse)
        with pytest.raises(ranges_module._NoReflinks):  # nothing written yet: the caller copies instead
            ranges_module.copy_range(source, 0, out, 0, len(data))
        ranges_module.copy_range(source, 0, out, 0, len(data), reflink=False)
    else:
        monkeypatch.setattr(ranges_module.os, "copy_file_range", refuse)
        ranges_module.copy_range(source, 0, out, 0, len(data), reflink=False)
    os.close(source), os.close(out)
    assert (tmp_path / "out").read_bytes() == data


def test_a_conversion_without_reflinks_or_copy_file_range_writes_the_same_files(tmp_path, monkeypatch):
    src = tmp_path / "pseudo"
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(src)
    convert_pseudo_to_real(src, tmp_path / "kernel", progress=False)

    def refuse(*args):
        raise OSError(errno.ENOSYS, "not here")

    monkeypatch.setattr(ranges_module.os, "copy_file_range", refuse)
    monkeypatch.setattr(ranges_module.fcntl, "ioctl", refuse)
    convert_pseudo_to_real(src, tmp_path / "user", progress=False)
    assert (tmp_path / "user" / "model.safetensors").read_bytes() == (
        tmp_path / "kernel" / "model.safetensors"
    ).read_bytes()


def test_write_checkpoint_and_copy_checkpoint_plan_the_same_shards(tmp_path):
    tensors = {f"layer.{i}": torch.full((100,), float(i)) for i in range(5)}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "src").mkdir()
    write_checkpoint(tmp_path / "src", tensors, progress=False)
    write_checkpoint(tmp_path / "a", tensors, max_shard_size=800, progress=False)
    ranges_module.copy_checkpoint(tmp_path / "b", read_weights(tmp_path / "src"), max_shard_size=800, progress=False)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name
    with CheckpointReader(tmp_path / "b") as reader:
        assert all(torch.equal(reader.get(name), tensors[name]) for name in tensors)


def test_later_copies_of_a_block_are_cloned_from_the_first_where_offsets_line_up(tmp_path, monkeypatch):
    """With reflinks, the L copies of a tensor whose size is a multiple of the filesystem block are cloned from its
    first copy in the shard (the source's offsets line up only by chance). The ioctl is simulated."""
    (tmp_path / "src").mkdir(), (tmp_path / "out").mkdir()
    block = os.statvfs(tmp_path).f_bsize
    write_checkpoint(tmp_path / "src", {"w": torch.arange(3 * block // 4, dtype=torch.float32)}, progress=False)
    source = read_weights(tmp_path / "src")["w"]
    clones = []

    def fake_ioctl(fd, request, arg):
        src_fd, src_offset, length, dst_offset = struct.unpack("qQQQ", arg)
        clones.append((src_fd == fd, src_offset, dst_offset, length))
        os.pwrite(fd, os.pread(src_fd, length, src_offset), dst_offset)

    monkeypatch.setattr(ranges_module.fcntl, "ioctl", fake_ioctl)
    ranges_module.copy_checkpoint(tmp_path / "out", {f"layers.{i}.w": source for i in range(4)}, max_shard_size=10**9)
    from_output = [clone for clone in clones if clone[0]]
    assert len(from_output) >= 2, clones  # copies 2..4 (their head and tail ranges copied, the middle cloned)
    assert all((dst - src) % (3 * block) == 0 for _, src, dst, _ in from_output)
    with CheckpointReader(tmp_path / "out") as reader:
        assert all(
            torch.equal(reader.get(f"layers.{i}.w"), torch.arange(3 * block // 4, dtype=torch.float32))
            for i in range(4)
        )


def test_copied_shards_are_allocated_before_the_copy(tmp_path, monkeypatch):
    """Without reflinks a shard's data blocks are allocated in one fallocate before its ranges are copied (from the
    first copied range to the end of the file); with reflinks, nothing is allocated (clones share blocks)."""
    src = tmp_path / "pseudo"
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(src)
    calls = []
    real = ranges_module._fallocate

    def spy(fd, mode, offset, nbytes):
        calls.append((os.fstat(fd).st_size, offset, nbytes))
        return real(fd, mode, offset, nbytes)

    monkeypatch.setattr(ranges_module, "_fallocate", spy)

    def refuse(*args):
        raise OSError(errno.EOPNOTSUPP, "no reflinks here")

    monkeypatch.setattr(ranges_module.fcntl, "ioctl", refuse)
    convert_pseudo_to_real(src, tmp_path / "real", max_shard_size=200_000, progress=False)
    shards = sorted((tmp_path / "real").glob("model-*.safetensors"))
    assert len(shards) > 1 and len(calls) == len(shards)  # one call per shard
    for size, offset, nbytes in calls:
        assert offset + nbytes == size and offset < size  # the rest of the shard, after its header

    def clone(fd, request, arg):  # a filesystem with reflinks
        src_fd, src_offset, length, dst_offset = struct.unpack("qQQQ", arg)
        os.pwrite(fd, os.pread(src_fd, length, src_offset), dst_offset)

    calls.clear()
    monkeypatch.setattr(ranges_module.fcntl, "ioctl", clone)
    convert_pseudo_to_real(src, tmp_path / "cloned", max_shard_size=200_000, progress=False)
    assert calls == []
    for path in shards:  # the same files either way
        assert path.read_bytes() == (tmp_path / "cloned" / path.name).read_bytes()


def test_allocate_reserves_the_blocks_and_reports_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "shard"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 1 << 20)
        assert os.fstat(fd).st_blocks == 0  # sparse
        ranges_module.allocate(fd, 4096, (1 << 20) - 4096)
        if os.fstat(fd).st_blocks == 0:
            pytest.skip("this filesystem cannot fallocate")
        assert os.fstat(fd).st_blocks * 512 >= (1 << 20) - 4096 and os.fstat(fd).st_size == 1 << 20

        def full(*args):
            ranges_module.ctypes.set_errno(errno.ENOSPC)
            return -1

        monkeypatch.setattr(ranges_module, "_fallocate", full)
        with pytest.raises(OSError) as info:
            ranges_module.allocate(fd, 0, 1 << 20)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_full_disk_stops_the_conversion_before_any_copy(tmp_path, monkeypatch):
    src = tmp_path / "pseudo"
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(src)
    copies = []
    monkeypatch.setattr(ranges_module.fcntl, "ioctl", lambda *a: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "")))
    monkeypatch.setattr(ranges_module, "_copy_bytes", lambda *args: copies.append(args))

    def full(*args):
        ranges_module.ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(ranges_module, "_fallocate", full)
    with pytest.raises(OSError, match="No space left on device: .*model.safetensors"):
        convert_pseudo_to_real(src, tmp_path / "real", progress=False)
    assert copies == [] and not (tmp_path / "real").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".real")]  # no temporary folder left
