import copy
import errno
import hashlib
import json
import os
import re
import resource
import runpy
import shlex
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from hf_p2r import P2RForCausalLM, convert_pseudo_to_real, export_llama
from hf_p2r.checkpoint import CheckpointReader, verify_checkpoint
from hf_p2r.checkpoint import ranges as ranges_module
from hf_p2r.checkpoint import writer as writer_module
from hf_p2r.cli import main

from ..conftest import tiny_model
from ..models.helpers import MODEL_FILES_WITH_CODE


def _pseudo(tmp_path, name="pseudo", seed=0, **overrides):
    fields = dict(share_layers=True, num_unique_layers=2) | overrides
    model = tiny_model(seed=seed, **fields)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


def _assert_same_weights(loaded, reference):
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize(
    ("k", "new_k", "pattern"),
    [(1, None, "cycle"), (2, None, "cycle"), (2, None, "sequence"), (2, 4, "cycle"), (2, 4, "sequence")],
)
def test_conversion_equals_in_memory_delink(tmp_path, input_ids, k, new_k, pattern):
    src, model = _pseudo(tmp_path, num_unique_layers=k, sharing_pattern=pattern)
    out = convert_pseudo_to_real(src, tmp_path / "out", num_unique_layers=new_k, verify=True)
    loaded = P2RForCausalLM.from_pretrained(out)
    reference = model.delink(new_k)
    _assert_same_weights(loaded, reference)
    assert (loaded.config.share_layers, loaded.config.num_unique_layers) == (new_k is not None, new_k or 8)
    config = json.loads((out / "config.json").read_text())
    assert (config["share_layers"], config["num_unique_layers"], config["sharing_pattern"]) == (
        new_k is not None,
        new_k or 8,
        pattern,
    )
    assert torch.equal(
        _logits(loaded, input_ids), _logits(P2RForCausalLM.from_pretrained(src, share_layers=False), input_ids)
    )
    assert _leftovers(tmp_path, "out") == [], "the temporary folder was renamed into place"


def test_sharded_input_and_output(tmp_path):
    model = tiny_model(seed=1, share_layers=True, num_unique_layers=2)
    model.save_pretrained(tmp_path / "pseudo", max_shard_size="20KB")
    assert (tmp_path / "pseudo" / "model.safetensors.index.json").exists()
    before = _hashes(tmp_path / "pseudo")
    out = convert_pseudo_to_real(tmp_path / "pseudo", tmp_path / "real", max_shard_size="30KB", verify=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    _assert_same_weights(P2RForCausalLM.from_pretrained(out), model.delink())
    assert _hashes(tmp_path / "pseudo") == before, "the source is never modified"


def test_llama_target_loads_in_vanilla_transformers(tmp_path, input_ids):
    src, model = _pseudo(tmp_path, seed=3)
    model.save_pretrained(src, remote_code=True)  # remote code must not leak into a Llama checkpoint
    llama_dir = convert_pseudo_to_real(src, tmp_path / "llama", target="llama", verify=True)
    p2r_dir = convert_pseudo_to_real(src, tmp_path / "p2r")
    config = json.loads((llama_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert not {"share_layers", "num_unique_layers", "sharing_pattern", "auto_map"} & config.keys()
    assert not list(llama_dir.glob("*.py"))
    llama = LlamaForCausalLM.from_pretrained(llama_dir)
    assert torch.equal(_logits(llama, input_ids), _logits(P2RForCausalLM.from_pretrained(p2r_dir), input_ids))
    torch.testing.assert_close(_logits(llama, input_ids), _logits(model.delink(), input_ids), rtol=1e-5, atol=1e-6)


def test_tied_embeddings_stay_tied(tmp_path, input_ids):
    src, model = _pseudo(tmp_path, tie_word_embeddings=True)
    out = convert_pseudo_to_real(src, tmp_path / "out", verify=True)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded = P2RForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_same_weights(loaded, model.delink())


def test_dtype_cast(tmp_path):
    src, model = _pseudo(tmp_path)
    out = convert_pseudo_to_real(src, tmp_path / "out", dtype="bfloat16", verify=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = P2RForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    _assert_same_weights(loaded, model.delink().to(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", torch.float8_e5m2, "int8", "torch.int32", "float128", "half"])
def test_only_loadable_dtypes(tmp_path, dtype):
    """float8 (or any dtype but these four) would write weights that from_pretrained cannot load as they are."""
    message = f"dtype: '{dtype}' is not one of float32, float16, bfloat16, float64"
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_pseudo_to_real(tmp_path / "missing", tmp_path / "out", dtype=dtype)  # before SRC is read
    assert not (tmp_path / "out").exists()


def test_float16_and_float64_casts_load(tmp_path, input_ids):
    src, model = _pseudo(tmp_path)
    real = model.delink()
    for dtype in (torch.float16, "torch.float64"):
        out = convert_pseudo_to_real(src, tmp_path / str(dtype), dtype=dtype, verify=True)
        loaded = P2RForCausalLM.from_pretrained(out, dtype="auto")
        assert str(loaded.dtype) == f"torch.{str(dtype).removeprefix('torch.')}"
        _assert_same_weights(loaded, copy.deepcopy(real).to(loaded.dtype))


def test_tokenizer_generation_config_and_remote_code_are_carried(tmp_path):
    src, model = _pseudo(tmp_path)
    model.save_pretrained(src, remote_code=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (src / name).write_text(f"{name} contents")
    (src / "additional_chat_templates").mkdir()  # transformers' named templates: {name}.jinja
    for name in ("tool_use", "rag"):
        (src / "additional_chat_templates" / f"{name}.jinja").write_text(f"{{{{ {name} }}}}")
    (src / "optimizer.pt").write_bytes(b"training state")
    out = convert_pseudo_to_real(src, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "additional_chat_templates",
        "chat_template.jinja",
        *MODEL_FILES_WITH_CODE,
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_text() == "tokenizer.json contents"
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert _hashes(out / "additional_chat_templates") == _hashes(src / "additional_chat_templates")
    assert sorted(p.name for p in (out / "additional_chat_templates").iterdir()) == ["rag.jinja", "tool_use.jinja"]
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_p2r.P2RForCausalLM"
    )


def test_model_card_records_provenance(tmp_path):
    src, _ = _pseudo(tmp_path, num_unique_layers=2, sharing_pattern="sequence")
    out = convert_pseudo_to_real(src, tmp_path / "real-8", dtype="float16")
    card = (out / "README.md").read_text()
    for text in ("source: pseudo", "source_num_unique_layers: 2", "num_unique_layers: 8", "sharing_pattern: sequence"):
        assert text in card
    assert "source_kind: pseudo" in card and "from the pseudo checkpoint `pseudo`" in card
    assert "dtype: float16 (cast from float32)" in card and "| dtype | float16 (cast from float32) |" in card
    assert "# real-8" in card and 'from_pretrained("real-8")' in card


def test_model_card_names_the_dtype_kept_and_a_real_source(tmp_path):
    src, model = _pseudo(tmp_path)
    model.to(torch.bfloat16).save_pretrained(src)
    card = (convert_pseudo_to_real(src, tmp_path / "real") / "README.md").read_text()
    assert "dtype: bfloat16 (unchanged)" in card and "unchanged" not in card.replace("bfloat16 (unchanged)", "")
    model.delink().save_pretrained(tmp_path / "real-src")  # bfloat16 too
    card = (export_llama(tmp_path / "real-src", tmp_path / "llama", dtype="float32") / "README.md").read_text()
    assert "source_kind: real" in card and "dtype: float32 (cast from bfloat16)" in card
    assert "Exported with `hf_p2r.export_llama`" in card and "from the real P2R checkpoint `real-src`" in card
    assert "pseudo checkpoint" not in card and "shared block" not in card


# --- bad input: one error naming the file and the problem, nothing written -------------------------------------------


def _relabel(path, name, dtype):
    """Rewrite the safetensors header of `path` so that tensor `name` claims `dtype` (same bytes: a lying header)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = dtype
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def _break(src, how):
    config_path = src / "config.json"
    config = json.loads(config_path.read_text())
    if how == "no config":
        config_path.unlink()
    elif how == "not p2r":
        config_path.write_text(json.dumps(config | {"model_type": "llama"}))
    elif how == "no weights":
        (src / "model.safetensors").unlink()
    elif how == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "shapes":
        config_path.write_text(json.dumps(config | {"intermediate_size": 48}))
    elif how == "blocks":
        config_path.write_text(json.dumps(config | {"num_unique_layers": 4}))
    elif how == "real":
        config_path.write_text(json.dumps(config | {"share_layers": False, "num_unique_layers": 8}))
    elif how == "bad json":
        config_path.write_text("{")
    elif how == "bad field":
        config_path.write_text(json.dumps(config | {"hidden_size": "big"}))
    elif how == "int dtype":  # F32 relabelled I32: same size, so safetensors accepts it
        _relabel(src / "model.safetensors", "lm_head.weight", "I32")
    elif how == "mixed dtype":  # a float16 file with one tensor relabelled bfloat16
        tiny_model(share_layers=True, num_unique_layers=2).to(torch.float16).save_pretrained(src)
        _relabel(src / "model.safetensors", "model.layers.1.self_attn.o_proj.weight", "BF16")


BAD_INPUTS = {
    "no config": (FileNotFoundError, r"pseudo: no config.json"),
    "not p2r": (ValueError, r"pseudo/config.json: model_type is 'llama', not 'p2r'"),
    "no weights": (FileNotFoundError, r"pseudo: no model.safetensors"),
    "truncated": (ValueError, r"pseudo/model.safetensors: not a valid safetensors file: .*truncated"),
    "shapes": (ValueError, r"pseudo/model.safetensors: model.layers.0.mlp.\w+_proj.weight has shape \[\d+, \d+\] but"),
    "blocks": (ValueError, r"pseudo: the weights hold 2 layer blocks \(blocks 0..1\) but .*config.json describes a "),
    "real": (ValueError, r"pseudo/config.json: share_layers is false: .* already a real checkpoint"),
    "bad json": (ValueError, r"pseudo/config.json: not valid JSON"),
    "bad field": (ValueError, r"pseudo/config.json: hidden_size must be a positive integer, got 'big'"),
    "int dtype": (
        ValueError,
        r"pseudo/model.safetensors: lm_head.weight is stored as int32, but model weights are floating point",
    ),
    "mixed dtype": (
        ValueError,
        r"pseudo/model.safetensors: model.layers.1.self_attn.o_proj.weight is stored as bfloat16, but \d+ other "
        r"tensors \(e.g. [\w.]+\) are float16",
    ),
}


@pytest.mark.parametrize("how", BAD_INPUTS)
def test_bad_input_is_one_clear_error(tmp_path, how):
    src, _ = _pseudo(tmp_path)
    _break(src, how)
    before = _hashes(src)
    error, message = BAD_INPUTS[how]
    with pytest.raises(error, match=message):
        convert_pseudo_to_real(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []
    assert _hashes(src) == before


def test_bad_sharded_input(tmp_path):
    model = tiny_model(share_layers=True, num_unique_layers=2)
    model.save_pretrained(tmp_path / "pseudo", max_shard_size="20KB")
    index_path = tmp_path / "pseudo" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="index.json: names shard model-00009-of-00009.safetensors"):
        convert_pseudo_to_real(tmp_path / "pseudo", tmp_path / "out")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_unique_layers=3), "pseudo: num_unique_layers=3 cannot be reached from 2"),
        # the rule and the message agree: 2 (the source's own count) is accepted, as a copy, and listed
        (
            dict(num_unique_layers=1),
            r"pseudo: num_unique_layers=1 cannot be reached from 2 blocks \(sharing_pattern='cycle', 8 layers\): every "
            r"depth must keep the block it ran; it can be 2 \(nothing to delink: a copy\), 4, 6, 8$",
        ),
        (dict(num_unique_layers=2.0), "num_unique_layers must be an integer, got 2.0"),
        (dict(num_unique_layers=4, target="llama"), "target='llama' needs the real model"),
        (dict(target="gguf"), "target must be 'p2r', 'llama' or 'mixtral', got 'gguf'"),
    ],
)
def test_bad_options(tmp_path, kwargs, message):
    src, _ = _pseudo(tmp_path)
    with pytest.raises(ValueError, match=message):
        convert_pseudo_to_real(src, tmp_path / "out", **kwargs)


def test_destination_rules(tmp_path):
    src, model = _pseudo(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="out: folder is not empty"):
        convert_pseudo_to_real(src, tmp_path / "out")
    # --overwrite replaces an earlier output, never a folder of someone's own files (issue 36)
    with pytest.raises(ValueError, match=r"out: holds mine\.txt, which no model folder of hf-p2r holds"):
        convert_pseudo_to_real(src, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    (tmp_path / "out" / "mine.txt").unlink()
    convert_pseudo_to_real(src, tmp_path / "out")
    convert_pseudo_to_real(src, tmp_path / "out", overwrite=True)  # an earlier output: replaced
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), model.delink())
    for dst in (src, src / "inside", tmp_path):
        with pytest.raises(ValueError, match="must not be the source"):
            convert_pseudo_to_real(src, dst, overwrite=True)


# --- failures mid-way: the destination is never partial --------------------------------------------------------------


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
@pytest.mark.parametrize("dtype", [None, "float16"], ids=["copy", "cast"])
def test_failure_mid_way_leaves_nothing(tmp_path, monkeypatch, failure, dtype):
    src, _ = _pseudo(tmp_path)
    module, name = (ranges_module, "copy_range") if dtype is None else (writer_module, "write_file")
    real, written = getattr(module, name), []

    def fail_after_first_write(*args, **kwargs):
        if written:
            raise failure
        real(*args, **kwargs)
        written.append(args)

    monkeypatch.setattr(module, name, fail_after_first_write)
    with pytest.raises(type(failure)):
        convert_pseudo_to_real(src, tmp_path / "out", max_shard_size="20KB", dtype=dtype)
    assert written, "the failure happened after output had been written"
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_verify_catches_wrong_bytes(tmp_path, monkeypatch):
    src, _ = _pseudo(tmp_path)
    real = ranges_module.copy_range

    def damaged(source, offset, out, out_offset, nbytes, **kwargs):  # right size, wrong bytes
        real(source, offset, out, out_offset, nbytes, **kwargs)
        os.pwrite(out, b"\x12\x34\x56\x78", out_offset)

    monkeypatch.setattr(ranges_module, "copy_range", damaged)
    convert_pseudo_to_real(src, tmp_path / "unverified")  # the control: without verify the damage goes unnoticed
    with pytest.raises(ValueError, match="verify failed: [\\w.]+ differs from its source"):
        convert_pseudo_to_real(src, tmp_path / "verified", verify=True)
    assert not (tmp_path / "verified").exists()


def test_verify_checks_names_shapes_and_dtypes(tmp_path):
    src, _ = _pseudo(tmp_path)
    out = convert_pseudo_to_real(src, tmp_path / "out")
    with CheckpointReader(out) as reader:
        expected = {name: (reader.get(name).clone(), reader.get(name).dtype) for name in reader.keys()}
    verify_checkpoint(out, expected)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="unexpected \\['model.norm.weight'\\]"):
        verify_checkpoint(out, {k: v for k, v in expected.items() if k != name})
    with pytest.raises(ValueError, match=f"{name} is torch.float32 \\[32\\], expected torch.float16"):
        verify_checkpoint(out, expected | {name: (expected[name][0], torch.float16)})


@pytest.mark.parametrize("dtype", [None, "float16"], ids=["copy", "cast"])
def test_progress_bar_counts_output_bytes(tmp_path, monkeypatch, dtype):
    src, _ = _pseudo(tmp_path)
    bars = []
    module = ranges_module if dtype is None else writer_module
    real_tqdm = module.tqdm

    def recording_tqdm(*args, **kwargs):
        bar = real_tqdm(*args, **kwargs | {"disable": True})
        bars.append((kwargs["total"], kwargs["unit"], updates := []))
        bar.update = updates.append
        return bar

    monkeypatch.setattr(module, "tqdm", recording_tqdm)
    out = convert_pseudo_to_real(src, tmp_path / "out", max_shard_size="30KB", dtype=dtype)
    ((total, unit, updates),) = bars
    size = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert (total, unit, sum(updates), len(updates)) == (size, "B", size, len(list(out.glob("model-*"))))


# --- export_llama from a folder ----------------------------------------------------------------------------------


def test_export_llama_streams_a_real_checkpoint_folder(tmp_path, input_ids):
    real = tiny_model(seed=5, share_layers=True, num_unique_layers=2).delink()
    real.save_pretrained(tmp_path / "real")
    out = export_llama(tmp_path / "real", tmp_path / "llama", verify=True)
    llama = LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(llama, input_ids), _logits(P2RForCausalLM.from_pretrained(tmp_path / "real"), input_ids))
    with pytest.raises(ValueError, match="share_layers is true .* target='llama'"):
        export_llama(_pseudo(tmp_path)[0], tmp_path / "nope")


# --- the command line ------------------------------------------------------------------------------------------------


def test_cli_converts_and_reports_errors_in_one_line(tmp_path, capsys):
    src, model = _pseudo(tmp_path)
    assert main(["convert", str(src), str(tmp_path / "out"), "--num-unique-layers", "4", "--verify"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), model.delink(4))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-p2r convert: error: ") and "not empty" in err


def _cli_error(capsys, *args) -> str:
    """Run `hf-p2r ARGS`, expecting exit 1 and exactly one line on stderr (no traceback); returns that line."""
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err, (code, err)
    return err.rstrip("\n")


@pytest.mark.parametrize("size", ["lots", "0", "-5MB", "5XB", "1e3"])
def test_cli_rejects_bad_shard_sizes_before_reading_src(tmp_path, capsys, size):
    line = _cli_error(capsys, "convert", tmp_path / "missing", tmp_path / "out", f"--max-shard-size={size}")
    assert line == f"hf-p2r convert: error: max_shard_size: '{size}' is not a size like 5GB or 500MB"


def test_cli_shard_sizes_in_bytes_or_units(tmp_path, capsys):
    src, model = _pseudo(tmp_path)
    real, layouts = model.delink(), {}
    for size, limit in (("20000", 20_000), ("20KB", 20_000), ("0.1MB", 100_000)):
        out = tmp_path / size
        assert main(["convert", str(src), str(out), "--max-shard-size", size]) == 0
        layouts[size] = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        with CheckpointReader(out) as reader:
            for shard in set(layouts[size].values()):
                names = [name for name, file in layouts[size].items() if file == shard]
                assert len(names) == 1 or sum(reader.get(n).nbytes for n in names) <= limit, (size, shard)
        _assert_same_weights(P2RForCausalLM.from_pretrained(out), real)
    assert layouts["20000"] == layouts["20KB"], "a plain number is bytes"
    assert len(set(layouts["0.1MB"].values())) < len(set(layouts["20KB"].values()))


def test_cli_rejects_a_dtype_that_would_not_load(tmp_path, capsys):
    src, _ = _pseudo(tmp_path)
    line = _cli_error(capsys, "convert", src, tmp_path / "out", "--dtype", "float8_e4m3fn")
    assert line == "hf-p2r convert: error: dtype: 'float8_e4m3fn' is not one of float32, float16, bfloat16, float64"
    assert not (tmp_path / "out").exists()


def _corrupt_header(src):
    data = bytearray((src / "model.safetensors").read_bytes())
    data[8:12] = b"{{{{"
    (src / "model.safetensors").write_bytes(bytes(data))


def _index_names_missing_tensor(src):
    (src / "model.safetensors").unlink()
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(src, max_shard_size="20KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_corrupt_header, "pseudo/model.safetensors: not a valid safetensors file: its header is not valid JSON"),
        (
            _index_names_missing_tensor,
            "pseudo/model.safetensors.index.json: lists model.layers.0.mlp.ghost.weight in model-0000",
        ),
        (lambda src: _break(src, "int dtype"), "pseudo/model.safetensors: lm_head.weight is stored as int32"),
        (lambda src: _break(src, "bad field"), "pseudo/config.json: hidden_size must be a positive integer, got 'big'"),
    ],
    ids=["corrupt header", "index names a missing tensor", "lying dtype", "invalid config field"],
)
def test_cli_reader_errors_are_one_line_naming_the_file(tmp_path, capsys, damage, expected):
    src, _ = _pseudo(tmp_path)
    damage(src)
    line = _cli_error(capsys, "convert", src, tmp_path / "out")
    assert line.startswith(f"hf-p2r convert: error: {src.parent}/{expected}"), line
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


# The lines of a slow CLI script that make every signal handler installed after them set `signalled` (a
# threading.Event) before it runs, SIGINT's (Python's KeyboardInterrupt) included.
NOTE_SIGNALS = """
install = signal.signal
def noting(signum, handler):
    if callable(handler):
        def noted(number, frame, inner=handler):
            signalled.set()
            inner(number, frame)
        return install(signum, noted)
    return install(signum, handler)
signal.signal = noting
signal.signal(signal.SIGINT, signal.default_int_handler)
"""


# `hf-p2r ARGS` that prints WROTE once its first bytes are in the output, then holds every copy until a signal has
# reached one of its handlers (or the file RELEASE exists): the test signals a conversion that is surely mid-way, and
# the copies go on only once the signal is being handled, whatever the load on the machine.
_SLOW_CLI = textwrap.dedent("""
    import os, signal, sys, threading, time
    from hf_p2r.checkpoint import ranges
    real, release, wrote, signalled = ranges.copy_range, os.environ["RELEASE"], [], threading.Event()
    def held(*args, **kwargs):
        real(*args, **kwargs)
        if not wrote:
            wrote.append(print("WROTE", flush=True))
        deadline = time.monotonic() + 120
        while not (signalled.is_set() or os.path.exists(release)) and time.monotonic() < deadline:
            time.sleep(0.02)
    ranges.copy_range = held
    {NOTE_SIGNALS}
    from hf_p2r.cli import main
    sys.exit(main(sys.argv[1:]))
""").replace("{NOTE_SIGNALS}\n", NOTE_SIGNALS.lstrip("\n"))


def _default_signals() -> None:
    for signum in (signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def _run_cli(tmp_path, args, script=None, env=None, **kwargs):
    """The command line in a subprocess whose SIGHUP and SIGINT are at their defaults, as in a terminal, even when the
    test suite itself runs under nohup or as a background job of a non-interactive shell, which ignores SIGINT (an
    ignored signal is inherited: the CLI would then keep it ignored, rightly); a test may give its own `preexec_fn`
    (nohup's)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "hf_p2r.cli"]
    kwargs.setdefault("preexec_fn", _default_signals)
    return subprocess.Popen(
        [*command, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs
    )


@pytest.mark.parametrize(
    ("sig", "message"),
    [
        (signal.SIGKILL, None),
        (signal.SIGINT, "interrupted"),  # Ctrl-C
        (signal.SIGTERM, "stopped by SIGTERM"),  # kill, timeout, a SLURM job's end
        (signal.SIGHUP, "stopped by SIGHUP"),  # the terminal closed
    ],
)
def test_conversion_killed_mid_way(tmp_path, sig, message):
    src, model = _pseudo(tmp_path)
    before = _hashes(src)
    release = {"RELEASE": str(tmp_path / "release")}
    args = ["convert", src, tmp_path / "out", "--max-shard-size", "20KB"]
    process = _run_cli(tmp_path, args, script=_SLOW_CLI, env=release)
    assert process.stdout.readline().startswith("WROTE"), process.stderr.read()
    assert _leftovers(tmp_path, "out") != [], "the control: the output was being written when the signal came"
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert not (tmp_path / "out").exists()
    assert _hashes(src) == before, "the source is byte-identical"
    if message is not None:  # cleaned up, one line, exit 128 + the signal number
        assert process.returncode == 128 + sig and err == f"hf-p2r convert: {message}\n"
        assert _leftovers(tmp_path, "out") == []
    else:  # kill -9 cannot clean up: only the hidden temporary folder remains, DST never appears...
        assert process.returncode == -signal.SIGKILL
        (leftover,) = _leftovers(tmp_path, "out")
        assert leftover.startswith(f".out.tmp-{process.pid}-")
        # ... until the next conversion to the same DST removes it (its process is gone)
        convert_pseudo_to_real(src, tmp_path / "out")
        assert _leftovers(tmp_path, "out") == []
        _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), model.delink())


def test_nohup_keeps_sighup_ignored(tmp_path):
    src, _ = _pseudo(tmp_path)
    process = _run_cli(
        tmp_path,
        ["convert", src, tmp_path / "out", "--max-shard-size", "20KB"],
        script=_SLOW_CLI,
        env={"RELEASE": str(tmp_path / "release")},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # what nohup does
    )
    assert process.stdout.readline().startswith("WROTE"), process.stderr.read()
    process.send_signal(signal.SIGHUP)
    time.sleep(0.5)  # time for the SIGHUP to arrive (and be ignored): released early, the test only proves less
    (tmp_path / "release").touch()
    _, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (0, ""), "the conversion went on to the end"
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_disk_full_through_the_cli(tmp_path):
    src, _ = _pseudo(tmp_path)

    def small_file_limit():  # a real write failure: files over 40 kB cannot be written (EFBIG, like ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    process = _run_cli(tmp_path, ["convert", src, tmp_path / "out"], preexec_fn=small_file_limit)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert err.startswith("hf-p2r convert: error: [Errno 27] File too large: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_script_wraps_the_cli(tmp_path, monkeypatch):
    src, model = _pseudo(tmp_path)
    script = Path(__file__).resolve().parents[2] / "scripts" / "convert_pseudo_to_real.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(src), str(tmp_path / "out"), "--target", "llama"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"


# --- the docs' section runs as written ----------------------------------------------------------------------------


def test_readme_examples_run_on_what_make_demo_writes(tmp_path, monkeypatch, capsys):
    """`make demo` (configs/demo.yaml) writes OUTPUT_DIR/pseudo just before the delink and OUTPUT_DIR/real at the end;
    the README's commands and code run on those folders as written, without two of them writing the same DST."""
    from accelerate import Accelerator

    from hf_p2r.training import checkpointing
    from hf_p2r.training.config import parse_config
    from hf_p2r.training.data import load_tokenizer
    from hf_p2r.training.train import build_model

    repo = Path(__file__).resolve().parents[2]
    section = (repo / "docs" / "checkpoints.md").read_text().split("## Pseudo → real on disk, streamed")[1]
    section = section.split("\n## ")[0]
    config = parse_config(["--config", str(repo / "configs" / "demo.yaml")])
    pseudo = Path(config.train.output_dir) / "pseudo"
    blocks = config.blocks_at(config.train.pseudo_steps - 1)  # the pseudo model saved before the delink
    assert f"`{pseudo}`" in section and f"{blocks} blocks" in section
    monkeypatch.chdir(tmp_path)
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    model = build_model(config, tokenizer, blocks)
    accelerator = Accelerator(cpu=True)
    checkpointing.save_model(accelerator, model, tokenizer, pseudo, config.train.remote_code)
    real = build_model(config, tokenizer, config.model.num_hidden_layers)
    checkpointing.save_model(accelerator, real, tokenizer, pseudo.parent / "real", config.train.remote_code)

    bash, python, library = re.findall(r"```(?:bash|python)\n(.*?)```", section, re.S)[:3]
    destinations = []
    for line in bash.splitlines():
        args = shlex.split(line.split("#")[0])
        assert args[:2] == ["hf-p2r", "convert"]
        destinations.append(args[3])
        assert main(args[1:]) == 0, capsys.readouterr().err
    exec(compile(python, "README.md", "exec"), {})
    destinations += re.findall(r'\("[^"]+", "(runs/[^"]+)"', python)  # (SRC, DST, ...)
    assert len(destinations) == len(set(destinations)) == 4, destinations
    for folder in map(Path, destinations):
        files = {p.name for p in folder.iterdir()}
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files, "small: one file"
        assert {"tokenizer.json", "generation_config.json", "README.md"} <= files
        # The model code travels only where the run saved it (remote_code) and only to P2R targets.
        assert ("modeling_p2r.py" in files) == (config.train.remote_code and "llama" not in folder.name), folder
    assert json.loads(Path("runs/llama/config.json").read_text())["model_type"] == "llama"
    assert json.loads(Path("runs/real-start/config.json").read_text())["share_layers"] is False
    exec(compile(library, "README.md", "exec"), {"model": model, "tokenizer": tokenizer})
    assert P2RForCausalLM.from_pretrained("runs/saved").config.num_unique_layers == model.config.num_unique_layers
