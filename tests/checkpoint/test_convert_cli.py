"""A new user's first hour with `hf-p2r convert`: a real checkpoint exports to vanilla Llama / Mixtral from the command
line, a block count that changes nothing says so (and the rule and the message agree), `--verify` says what it
verified."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM, MixtralForCausalLM

from hf_p2r import P2RForCausalLM
from hf_p2r.cli import main
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM

from ..models.test_modeling_p2r_moe import moe_model
from .test_convert import _assert_same_weights, _hashes, _logits, _pseudo


def _run(capsys, *args):
    """`hf-p2r ARGS`: (exit status, stdout, stderr lines)."""
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_real_checkpoint_exports_to_vanilla_transformers_from_the_command_line(tmp_path, capsys, input_ids, kind):
    """`hf-p2r convert REAL DST --target llama` was refused and sent the user to Python (`export_llama`); now it
    writes the Llama (dense) or Mixtral (MoE) checkpoint, streamed, with the P2R model's logits bit for bit."""
    if kind == "dense":
        real, target, vanilla, ours = _pseudo(tmp_path)[1].delink(), "llama", LlamaForCausalLM, P2RForCausalLM
    else:
        model = moe_model(seed=3, share_layers=True, num_unique_layers=2)
        real, target, vanilla, ours = model.delink(), "mixtral", MixtralForCausalLM, P2RMoeForCausalLM
    real.save_pretrained(tmp_path / "real")
    before = _hashes(tmp_path / "real")
    code, out, err = _run(capsys, "convert", tmp_path / "real", tmp_path / target, "--target", target, "--verify")
    assert (code, out.strip()) == (0, str(tmp_path / target)), err
    assert len(err) == 1 and err[0].startswith("hf-p2r convert: verified "), err
    config = json.loads((tmp_path / target / "config.json").read_text())
    assert config["model_type"] == target and "share_layers" not in config
    exported = vanilla.from_pretrained(tmp_path / target)
    reference = ours.from_pretrained(tmp_path / "real")
    assert torch.equal(_logits(exported, input_ids), _logits(reference, input_ids))
    assert _hashes(tmp_path / "real") == before
    wrong = {"llama": "mixtral", "mixtral": "llama"}[target]  # the other vanilla target: one line, nothing written
    code, _, err = _run(capsys, "convert", tmp_path / "real", tmp_path / "wrong", "--target", wrong)
    assert code == 2 and len(err) == 1 and f"use '{target}'" in err[0] and not (tmp_path / "wrong").exists()


def test_a_real_checkpoint_to_p2r_is_a_cast_or_refused(tmp_path, capsys):
    _, model = _pseudo(tmp_path)
    real = model.delink()
    real.save_pretrained(tmp_path / "real")
    code, _, err = _run(capsys, "convert", tmp_path / "real", tmp_path / "out")
    assert code == 2 and len(err) == 1, err
    assert "already a real checkpoint, there is nothing to delink; export it with target='llama'" in err[0]
    code, _, err = _run(capsys, "convert", tmp_path / "real", tmp_path / "bf16", "--dtype", "bfloat16")
    note = f"nothing to delink: {tmp_path / 'real'} already has 8 blocks; {tmp_path / 'bf16'} is cast from float32"
    assert code == 0 and err == [f"hf-p2r convert: warning: {note} to bfloat16"]
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16), real.bfloat16())


def test_the_source_block_count_is_a_copy_that_says_so(tmp_path, capsys):
    """The README's `--num-unique-layers 4` on a pseudo model that already had 4 blocks was a silent copy, while 3 was
    refused with a range (4 < K <= 8) that excluded 4 too. Now K = k is accepted and announced, and the refusal lists
    what K can be, k included."""
    src, model = _pseudo(tmp_path, num_unique_layers=4)
    code, out, err = _run(capsys, "convert", src, tmp_path / "same", "--num-unique-layers", "4")
    assert (code, out.strip()) == (0, str(tmp_path / "same"))
    assert err == [
        f"hf-p2r convert: warning: nothing to delink: {src} already has 4 blocks; {tmp_path / 'same'} is a copy"
    ]
    _assert_same_weights(P2RForCausalLM.from_pretrained(tmp_path / "same"), model)
    for blocks in (3, 2, 6, 9):
        code, _, err = _run(capsys, "convert", src, tmp_path / "out", "--num-unique-layers", blocks)
        assert code == 2 and err == [
            f"hf-p2r convert: error: {src}: num_unique_layers={blocks} cannot be reached from 4 blocks "
            "(sharing_pattern='cycle', 8 layers): every depth must keep the block it ran; it can be 4 (nothing to "
            "delink: a copy), 8"
        ], err
    assert not (tmp_path / "out").exists()


def test_verify_says_what_it_verified(tmp_path, capsys):
    src, model = _pseudo(tmp_path)
    code, out, err = _run(capsys, "convert", src, tmp_path / "out", "--verify", "--max-shard-size", "30KB")
    files = len(list((tmp_path / "out").glob("model-*.safetensors")))
    assert (code, out.strip()) == (0, str(tmp_path / "out")) and files > 1
    assert err == [
        f"hf-p2r convert: verified 75 tensors in {files} files before the rename: names, shapes and dtypes as planned, "
        f"every byte equal to its source tensor's; each of the 8 blocks is the block its depths ran in {src} (2 blocks)"
    ]
    code, _, err = _run(capsys, "convert", src, tmp_path / "half", "--verify", "--dtype", "float16")
    assert code == 0 and "every byte equal to its source tensor's cast to float16" in err[0]
    code, _, err = _run(capsys, "convert", src, tmp_path / "plain")
    assert code == 0 and err == [], "nothing on stderr without --verify"
