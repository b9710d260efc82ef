"""Nothing a user gives `hf-p2r convert` loses work, hangs or crashes: sizes from config.json are bounded before work
grows with them, links out of SRC are not followed, two conversions to one DST do not overwrite each other, a DST that
is a link is written through. Where the point is the absence of a hang or a traceback, a fresh process with a timeout
runs the command."""

import json
import os
import subprocess
import sys

import pytest

from hf_p2r import P2RForCausalLM, convert_pseudo_to_real
from hf_p2r.checkpoint import convert as convert_module

from ..models.test_modeling_p2r_moe import moe_model
from .test_convert import _assert_same_weights, _hashes, _leftovers, _pseudo


def _cli(*args, timeout=60):
    """`hf-p2r ARGS` in a fresh process (killed after `timeout` s: a hang fails the test): (exit status, stdout,
    stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    return result.returncode, result.stdout, result.stderr


def _edit_config(folder, **fields):
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


# --- sizes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_hidden_layers=10**9), "num_hidden_layers is 1000000000, more than any model has \\(at most 10000\\)"),
        (dict(num_hidden_layers=10**9, share_layers=False), "num_hidden_layers is 1000000000"),
        (dict(hidden_size=-5), "hidden_size must be a positive integer, got -5"),
        (dict(hidden_size=-64), "hidden_size must be a positive integer, got -64"),
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(intermediate_size=64.0), "intermediate_size must be a positive integer, got 64.0"),
        (dict(num_attention_heads=3), "hidden_size \\(32\\) must be a multiple of num_attention_heads \\(3\\)"),
        (dict(num_key_value_heads=3), "num_attention_heads \\(4\\) must be a multiple of num_key_value_heads \\(3\\)"),
        (dict(share_layers="yes"), "share_layers must be true or false, got 'yes'"),
        (dict(num_unique_layers=True), "num_unique_layers must be an integer with 1 <= num_unique_layers < num_hid"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_config_sizes_are_checked_before_any_work(tmp_path, fields, message):
    """One line, exit 2, within seconds: `num_hidden_layers: 10**9` once allocated until MemoryError (the depth ->
    block map), `hidden_size: -5` crashed the planner."""
    src, _ = _pseudo(tmp_path)
    _edit_config(src, **fields)
    code, out, err = _cli("convert", src, tmp_path / "out")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"hf-p2r convert: error: {src / 'config.json'}: ") and len(err) < 600, err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_huge_expert_counts_are_checked_against_the_headers(tmp_path):
    """A MoE config.json with a huge num_experts once hung (one name per expert, per block): it is bounded, and within
    the bound checked against the tensors the headers hold before anything is listed per expert."""
    moe_model(share_layers=True, num_unique_layers=2, num_experts=4).save_pretrained(tmp_path / "pseudo")
    src = tmp_path / "pseudo"
    _edit_config(src, num_experts=10**9)
    code, _, err = _cli("convert", src, tmp_path / "out")
    assert code == 2 and err.rstrip().endswith("num_experts is 1000000000, more than any model has (at most 65536)")
    _edit_config(src, num_experts=60_000)
    code, _, err = _cli("convert", src, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert err.rstrip().endswith("describes a model of 360017 tensors but the weights hold 41"), err


def test_an_output_too_large_to_plan_is_refused_before_reading_the_weights(tmp_path, monkeypatch):
    src, _ = _pseudo(tmp_path)
    monkeypatch.setattr(convert_module, "MAX_TENSORS", 50)  # the real model has 75
    with pytest.raises(ValueError, match="config.json: the output would hold 75 tensors \\(8 blocks\\), more than"):
        convert_pseudo_to_real(src, tmp_path / "out")


def test_from_pretrained_refuses_what_convert_refuses(tmp_path):
    """One validator for both: `share_layers: "yes"` once passed `convert` (truthy) and failed `from_pretrained`."""
    src, _ = _pseudo(tmp_path)
    saved = (src / "config.json").read_text()
    for fields in (dict(share_layers="yes"), dict(num_hidden_layers=10**9), dict(hidden_size=-64)):
        (src / "config.json").write_text(saved)
        _edit_config(src, **fields)
        field = next(iter(fields))
        with pytest.raises(ValueError, match=field):
            convert_pseudo_to_real(src, tmp_path / "out")
        with pytest.raises(Exception, match=field):
            P2RForCausalLM.from_pretrained(src)


@pytest.mark.parametrize(
    "damage",
    ["deep", "huge", "fifo weights", "/dev/zero weights"],
)
def test_any_json_or_weights_file_is_one_line(tmp_path, damage):
    src, _ = _pseudo(tmp_path)
    if damage == "deep":
        (src / "config.json").write_text("[" * 1_000_000)
        expected = "config.json: not valid JSON (nested too deeply)"
    elif damage == "huge":
        with open(src / "config.json", "r+b") as file:
            file.truncate(300 << 20)  # sparse: 300 MB of zeros
        expected = "config.json: over 256 MiB, too large for a JSON file hf-p2r reads"
    else:
        (src / "model.safetensors").unlink()
        if damage == "fifo weights":
            os.mkfifo(src / "model.safetensors")
            expected = "model.safetensors: a FIFO: not read"
        else:
            (src / "model.safetensors").symlink_to("/dev/zero")
            expected = "model.safetensors: a link to a character device (/dev/zero): not read"
    code, _, err = _cli("convert", src, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


# --- links out of SRC ------------------------------------------------------------------------------------------------


def test_carried_files_outside_src_are_skipped_and_named(tmp_path):
    """additional_chat_templates a link to /proc/self once hung `convert` (it copied the tree through links);
    tokenizer.json a link to /proc/self/environ copied the environment (tokens) into a folder meant for upload. Files
    within SRC are carried, links within SRC too; the rest is skipped with a line each, and the conversion goes on."""
    src, model = _pseudo(tmp_path)
    (tmp_path / "secret.txt").write_text("token")
    (src / "tokenizer.json").symlink_to("/proc/self/environ")
    (src / "vocab.json").symlink_to("/proc/self/fd/0")  # the converter's stdin: a pipe left open
    (src / "tokenizer_config.json").symlink_to(tmp_path / "secret.txt")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "special_tokens_map.json").symlink_to("chat_template.jinja")  # within SRC: carried
    os.mkfifo(src / "tokenizer.model")
    (src / "additional_chat_templates").symlink_to("/proc/self")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_p2r.cli", "convert", str(src), str(tmp_path / "out")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    try:
        process.wait(timeout=60)  # stdin stays open: reading it would never end
    finally:
        process.kill()
        out, err = process.stdout.read(), process.stderr.read()
        process.stdin.close()
    assert (process.returncode, out.strip()) == (0, str(tmp_path / "out")), err
    lines = sorted(err.splitlines())
    assert len(lines) == 5, err
    skipped = "hf-p2r convert: warning: skipped"
    assert lines[0].startswith(f"{skipped} additional_chat_templates: a link to a folder (/proc/")
    assert lines[1].startswith(f"{skipped} tokenizer.json: a link out of {src} (to /proc/")
    assert lines[2] == f"{skipped} tokenizer.model: a FIFO"
    assert lines[3] == f"{skipped} tokenizer_config.json: a link out of {src} (to {tmp_path / 'secret.txt'})"
    assert lines[4].startswith(f"{skipped} vocab.json: ")
    carried = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert carried == ["README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                       "special_tokens_map.json"]  # fmt: skip
    assert not (tmp_path / "out" / "special_tokens_map.json").is_symlink(), "copied, not linked"
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), model.delink())


def test_weights_out_of_src_are_refused(tmp_path):
    src, _ = _pseudo(tmp_path)
    (src / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match=f"model.safetensors: a link out of {src} \\(to .*elsewhere.safetensors\\)"):
        convert_pseudo_to_real(src, tmp_path / "out")


def test_a_hub_cache_snapshot_converts_through_its_links(tmp_path):
    """The links of a Hugging Face cache snapshot lead into its repository's blobs: that is what the cache is."""
    src, model = _pseudo(tmp_path)
    repo = tmp_path / "hub" / "models--org--pseudo"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in src.iterdir():
        path.rename(repo / "blobs" / path.name)
        (snapshot / path.name).symlink_to(f"../../blobs/{path.name}")
    convert_pseudo_to_real(snapshot, tmp_path / "out")
    assert (tmp_path / "out" / "generation_config.json").is_file()
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), model.delink())


# --- DST --------------------------------------------------------------------------------------------------------------


def test_two_conversions_to_one_dst_do_not_overwrite_each_other(tmp_path, monkeypatch):
    """The later of two conversions to one DST (without --overwrite) once silently replaced the earlier's finished
    output: the check at start passed for both. Now the later is refused at its rename, the earlier's output kept."""
    first, first_model = _pseudo(tmp_path, "first", seed=1)
    second, _ = _pseudo(tmp_path, "second", seed=2)
    real = convert_module._write_the_rest

    def meanwhile(src, *args):  # while the second conversion writes, the first one finishes
        real(src, *args)
        if src == second:
            convert_pseudo_to_real(first, tmp_path / "out")

    monkeypatch.setattr(convert_module, "_write_the_rest", meanwhile)
    with pytest.raises(FileExistsError, match="out: another process wrote this folder while this one ran"):
        convert_pseudo_to_real(second, tmp_path / "out")
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "out"), first_model.delink())
    assert _leftovers(tmp_path, "out") == []


def test_a_dst_that_is_a_link_is_written_through(tmp_path):
    src, model = _pseudo(tmp_path)
    (tmp_path / "runs" / "2026-01").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("2026-01")
    before = _hashes(src)
    out = convert_pseudo_to_real(src, tmp_path / "runs" / "latest")
    assert out == tmp_path / "runs" / "latest" and out.is_symlink()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["2026-01", "latest"], "nothing left beside"
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "runs" / "2026-01"), model.delink())
    with pytest.raises(FileExistsError, match="2026-01: folder is not empty"):
        convert_pseudo_to_real(src, tmp_path / "runs" / "latest")
    (tmp_path / "inside").symlink_to(src)  # a link into SRC: refused like SRC itself
    with pytest.raises(ValueError, match="must not be the source"):
        convert_pseudo_to_real(src, tmp_path / "inside", overwrite=True)
    assert _hashes(src) == before


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_count_is_the_plans_length(kind):
    """The count that guards the plan is the plan's length, for every layout the converter tests."""
    from ..conftest import tiny_config
    from ..models.test_modeling_p2r_moe import moe_config
    from .test_convert_moe import LAYOUTS
    from .test_ranges import CONFIGS

    layouts, build = (CONFIGS, tiny_config) if kind == "dense" else (LAYOUTS, moe_config)
    for fields in layouts.values():
        config = build(**(dict(share_layers=True) | fields)).to_dict()
        for blocks in (config["num_unique_layers"], 8):
            shapes = convert_module.parameter_shapes(config, blocks)
            assert convert_module.tensor_count(config, blocks) == len(shapes), (fields, blocks)


# --- issue 36: an output folder is never the input's home; names from disk are printed escaped --------------------


@pytest.mark.parametrize("holds", ["a training run", "someone's files"])
def test_overwrite_replaces_an_earlier_output_only(tmp_path, holds):
    """`--overwrite` onto a folder holding a training run (its checkpoints, its metrics) or files no model folder
    holds: refused in one line, exit 2, the folder as it was. Onto an earlier output: replaced."""
    src, _ = _pseudo(tmp_path)
    dst = tmp_path / "dst"
    dst.mkdir()
    if holds == "a training run":
        (dst / "checkpoints/checkpoint-1").mkdir(parents=True)
        (dst / "checkpoints/checkpoint-1/trainer_state.json").write_text("{}")
        (dst / "metrics.jsonl").write_text("{}\n")
    else:
        (dst / "config.json").write_text("{}")
        (dst / "thesis.tex").write_text("years of work")
    before = {str(p): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    code, out, err = _cli("convert", src, dst, "--overwrite")
    expected = "holds a training run (checkpoints, metrics.jsonl)" if holds == "a training run" else "holds thesis.tex"
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
    assert {str(p): p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before
    convert_pseudo_to_real(src, tmp_path / "earlier")
    code, out, err = _cli("convert", src, tmp_path / "earlier", "--overwrite")
    assert code == 0, err


def test_a_shard_name_with_control_characters_is_shown_escaped(tmp_path):
    """An index naming a shard "a\\nhf-p2r convert: done" cannot forge a line: one line, the name escaped."""
    src, _ = _pseudo(tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "a\nhf-p2r convert: done\x1b[2K"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out, err = _cli("convert", src, tmp_path / "out")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "names shard a\\nhf-p2r convert: done\\x1b[2K, which does not exist" in err and "\x1b" not in err
