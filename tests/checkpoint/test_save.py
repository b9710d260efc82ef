"""`hf_p2r.checkpoint.save_model` writes what `save_pretrained` writes, through the package's own writer."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

from hf_p2r import P2RForCausalLM, export_llama
from hf_p2r.checkpoint import save_model
from hf_p2r.checkpoint import writer as writer_module
from hf_p2r.training.data import byte_level_tokenizer

from ..conftest import tiny_model

LAYOUTS = {
    "pseudo": dict(share_layers=True, num_unique_layers=2),
    "pseudo tied": dict(share_layers=True, num_unique_layers=2, tie_word_embeddings=True),
    "real": {},
    "real tied": dict(tie_word_embeddings=True),
}


@pytest.fixture
def no_save_pretrained(monkeypatch):
    """Any weight write through transformers' save_pretrained fails the test: saves go through write_checkpoint."""
    written = []
    real = writer_module.write_file

    def spy(path, *args, **kwargs):
        written.append(path.name)
        return real(path, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("save_pretrained was called")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", forbidden)
    monkeypatch.setattr(writer_module, "write_file", spy)
    return written


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def _loaded(cls, folder, **kwargs):
    model, info = cls.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("remote_code", [False, True])
def test_same_folder_as_save_pretrained(tmp_path, layout, remote_code):
    model = tiny_model(**LAYOUTS[layout])
    tokenizer = byte_level_tokenizer()
    model.save_pretrained(tmp_path / "reference", remote_code=remote_code, max_shard_size="30KB")
    tokenizer.save_pretrained(tmp_path / "reference")
    config_before = model.config.to_dict()
    save_model(model, tmp_path / "ours", remote_code=remote_code, tokenizer=tokenizer, max_shard_size="30KB")

    files = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == files
    assert ("modeling_p2r.py" in files) == remote_code and "model.safetensors.index.json" in files
    for name in files:
        ours, reference = tmp_path / "ours" / name, tmp_path / "reference" / name
        if name.endswith(".safetensors"):
            mine, theirs = load_file(ours), load_file(reference)
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
        elif name.endswith(".json"):
            assert json.loads(ours.read_text()) == json.loads(reference.read_text()), name
        else:
            assert ours.read_bytes() == reference.read_bytes(), name
    assert model.config.to_dict() == config_before and "auto_map" not in model.config.to_dict()
    assert "_auto_class" not in vars(model), "the model is not changed"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_with_equal_logits(tmp_path, input_ids, no_save_pretrained, layout):
    model = tiny_model(**LAYOUTS[layout])
    save_model(model, tmp_path / "out", remote_code=True)
    assert no_save_pretrained == ["model.safetensors"], "one file for a small model, no index"
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")) is not tied
    for loaded in (
        _loaded(P2RForCausalLM, tmp_path / "out"),
        _loaded(AutoModelForCausalLM, tmp_path / "out", trust_remote_code=True),
    ):
        assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied


def test_remote_code_loads_without_hf_p2r(tmp_path, input_ids):
    model = tiny_model(share_layers=True, num_unique_layers=2, tie_word_embeddings=True)
    save_model(model, tmp_path / "out", remote_code=True, tokenizer=byte_level_tokenizer())
    torch.save({"input_ids": input_ids, "logits": _logits(model, input_ids)}, tmp_path / "reference.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        ref = torch.load({str(tmp_path / "reference.pt")!r}, weights_only=True)
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True).eval()
        AutoTokenizer.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True)
        assert "hf_p2r" not in sys.modules, "the folder must not need hf_p2r"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(model(ref["input_ids"]).logits, ref["logits"])
        print(type(model).__module__)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("transformers_modules.")


def test_given_state_dict_and_dtype_in_config(tmp_path, no_save_pretrained):
    """A gathered state dict (what sharded training passes) is what is written; config.json says its dtype."""
    model = tiny_model()
    state_dict = {name: tensor.to(torch.bfloat16) + 1 for name, tensor in model.state_dict().items()}
    save_model(model, tmp_path / "out", state_dict=state_dict)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == state_dict.keys() and all(torch.equal(written[k], state_dict[k]) for k in written)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_refuses_non_empty_folder_unless_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="out: folder is not empty"):
        save_model(tiny_model(), tmp_path / "out")
    save_model(tiny_model(), tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "mine.txt").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_export_llama_of_a_model_loads_in_vanilla_transformers(tmp_path, input_ids, no_save_pretrained, tied):
    real = tiny_model(share_layers=True, num_unique_layers=2, tie_word_embeddings=tied).delink()
    out = export_llama(real, tmp_path / "llama")
    assert no_save_pretrained == ["model.safetensors"]
    assert not list(out.glob("*.py")) and "auto_map" not in json.loads((out / "config.json").read_text())
    llama = _loaded(LlamaForCausalLM, out)
    assert torch.equal(_logits(llama, input_ids), _logits(real, input_ids))
    assert (llama.lm_head.weight is llama.model.embed_tokens.weight) is tied
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
