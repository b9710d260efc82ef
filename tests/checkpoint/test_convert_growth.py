"""`hf-p2r convert --num-hidden-layers`: a shallow checkpoint grown in depth on disk is the model `delink()` grows in
memory, tensor for tensor, with the function-preserving zeros where they belong; refusals are one line."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_p2r import P2RForCausalLM, convert_pseudo_to_real
from hf_p2r.cli import main
from hf_p2r.errors import InputError
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM

from ..conftest import tiny_model
from ..models.test_modeling_p2r_moe import moe_model
from .test_convert import _assert_same_weights, _hashes, _logits


def _shallow(tmp_path, moe=False, **overrides):
    fields = {"num_hidden_layers": 2, "real_num_hidden_layers": 8, **overrides}
    model = moe_model(seed=4, **fields) if moe else tiny_model(seed=4, **fields)
    model.save_pretrained(tmp_path / "shallow")
    return tmp_path / "shallow", fields


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("growth", ["stack", "interleave"])
@pytest.mark.parametrize("function_preserving", [False, True])
def test_a_grown_checkpoint_is_the_model_delink_grows(tmp_path, input_ids, moe, growth, function_preserving):
    layout = dict(share_layers=True, num_unique_layers=1) if moe else dict(attention_bias=True)
    src, fields = _shallow(tmp_path, moe, **layout)
    before = _hashes(src)
    out = convert_pseudo_to_real(
        src,
        tmp_path / "grown",
        num_hidden_layers=8,
        growth=growth,
        function_preserving=function_preserving,
        verify=True,
        progress=False,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_unique_layers"], config["share_layers"]) == (8, 8, False)
    assert config["real_num_hidden_layers"] is None
    model_class = P2RMoeForCausalLM if moe else P2RForCausalLM
    grown = model_class.from_pretrained(out)
    reference = (moe_model(seed=4, **fields) if moe else tiny_model(seed=4, **fields)).delink(
        growth=growth, function_preserving=function_preserving
    )
    _assert_same_weights(grown, reference)
    assert torch.equal(_logits(grown, input_ids), _logits(reference, input_ids))
    if function_preserving:
        shallow = model_class.from_pretrained(src)
        assert torch.equal(_logits(grown, input_ids), _logits(shallow, input_ids))
    assert _hashes(src) == before


def test_the_command_line_grows_and_exports_a_grown_model_to_llama(tmp_path, capsys, input_ids):
    src, _ = _shallow(tmp_path)
    args = [src, tmp_path / "llama", "--num-hidden-layers", "8", "--growth", "interleave", "--function-preserving"]
    code = main([str(arg) for arg in [*("convert",), *args, "--target", "llama", "--verify"]])
    out, err = capsys.readouterr()
    assert (code, out.strip()) == (0, str(tmp_path / "llama")), err
    assert "new residual outputs all zeros" in err
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    assert llama.config.num_hidden_layers == 8 and "real_num_hidden_layers" not in llama.config.to_dict()
    assert torch.equal(_logits(llama, input_ids), _logits(P2RForCausalLM.from_pretrained(src), input_ids))


@pytest.mark.parametrize(
    ("fields", "options", "message"),
    [
        ({}, dict(num_hidden_layers=1), "num_hidden_layers must be an integer with 2 <= num_hidden_layers"),
        ({}, dict(function_preserving=True), "function_preserving: nothing grows"),
        ({}, dict(num_hidden_layers=8, num_unique_layers=4, function_preserving=True), "block 0 would run both"),
        (dict(depth_mup=True, num_hidden_layers=3), dict(num_hidden_layers=8, function_preserving=True), "depth_mup"),
        ({}, dict(), r"shallow checkpoint with a block per layer .*\(--num-hidden-layers 8\)"),
    ],
)
def test_growths_the_converter_refuses_are_one_line_and_write_nothing(tmp_path, fields, options, message):
    src, _ = _shallow(tmp_path, **fields)
    with pytest.raises(InputError, match=message):
        convert_pseudo_to_real(src, tmp_path / "out", progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_a_depth_mup_model_has_no_llama_equivalent(tmp_path):
    src, _ = _shallow(tmp_path, depth_mup=True)
    with pytest.raises(ValueError, match="depth_mup=True .* no Llama equivalent"):
        convert_pseudo_to_real(src, tmp_path / "llama", num_hidden_layers=8, target="llama", progress=False)
    assert not (tmp_path / "llama").exists()
