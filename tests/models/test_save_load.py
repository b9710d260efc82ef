import copy
import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    modeling_utils,
)
from transformers.testing_utils import CaptureLogger

from hf_p2r import P2RConfig, P2RForCausalLM, P2RModel, export_llama
from hf_p2r.models.p2r import modeling_p2r

from ..conftest import tiny_config, tiny_model
from .helpers import assert_export_matches, load_as_remote_code


@pytest.fixture
def pseudo_dir(tmp_path):
    model = tiny_model(seed=2, num_hidden_layers=8, share_layers=True, num_unique_layers=2)
    model.save_pretrained(tmp_path / "pseudo")
    return tmp_path / "pseudo", model


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def test_pseudo_checkpoint_stores_only_its_blocks(pseudo_dir):
    path, _ = pseudo_dir
    with safe_open(path / "model.safetensors", "pt") as f:
        layer_keys = [k for k in f.keys() if ".layers." in k]
    assert {k.split(".")[2] for k in layer_keys} == {"0", "1"}
    assert json.loads((path / "config.json").read_text())["share_layers"] is True


def test_from_pretrained_pseudo_round_trip(pseudo_dir, input_ids):
    path, model = pseudo_dir
    loaded = P2RForCausalLM.from_pretrained(path)
    assert (loaded.config.share_layers, len(loaded.model.layers)) == (True, 2)
    assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))


def test_from_pretrained_pseudo_as_real(pseudo_dir, input_ids, monkeypatch):
    path, model = pseudo_dir
    built = []
    init = modeling_p2r.P2RDecoderLayer.__init__

    def counting_init(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(modeling_p2r.P2RDecoderLayer, "__init__", counting_init)
    real, info = P2RForCausalLM.from_pretrained(path, share_layers=False, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert len(built) == 2, "only the stored blocks are built; the other six are copies made by delink"
    assert (real.config.share_layers, real.config.num_unique_layers, len(real.model.layers)) == (False, 8, 8)
    assert torch.equal(_logits(real, input_ids), _logits(model, input_ids))
    assert len({p.data_ptr() for p in real.parameters()}) == len(list(real.parameters()))


def test_from_pretrained_partial_delink(pseudo_dir, input_ids):
    path, model = pseudo_dir
    wider = P2RForCausalLM.from_pretrained(path, num_unique_layers=4)
    assert (wider.config.share_layers, len(wider.model.layers)) == (True, 4)
    assert torch.equal(_logits(wider, input_ids), _logits(model, input_ids))


def test_auto_classes_apply_overrides(pseudo_dir, input_ids):
    path, model = pseudo_dir
    assert isinstance(AutoConfig.from_pretrained(path), P2RConfig)
    real = AutoModelForCausalLM.from_pretrained(path, share_layers=False)
    assert isinstance(real, P2RForCausalLM) and len(real.model.layers) == 8
    assert torch.equal(_logits(real, input_ids), _logits(model, input_ids))
    wider = AutoModelForCausalLM.from_pretrained(path, num_unique_layers=4)
    assert len(wider.model.layers) == 4
    base = AutoModel.from_pretrained(path)
    assert isinstance(base, P2RModel)


def test_auto_from_config_builds_p2r_models():
    config = tiny_config(share_layers=True)
    assert isinstance(AutoModelForCausalLM.from_config(config), P2RForCausalLM)
    assert isinstance(AutoModel.from_config(config), P2RModel)
    assert AutoConfig.for_model("p2r").model_type == "p2r"


@pytest.mark.parametrize(
    "overrides", [dict(num_unique_layers=1), dict(num_unique_layers=3), dict(sharing_pattern="sequence")]
)
def test_from_pretrained_rejects_function_changing_layouts(pseudo_dir, overrides):
    path, _ = pseudo_dir
    with pytest.raises(ValueError, match="num_unique_layers|blocks"):
        P2RForCausalLM.from_pretrained(path, **overrides)


@pytest.mark.parametrize("overrides", [dict(share_layers=True, num_unique_layers=2), dict(share_layers=True)])
def test_real_checkpoint_cannot_be_reshared(tmp_path, overrides):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot load"):
        P2RForCausalLM.from_pretrained(tmp_path, **overrides)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(share_layers=False, num_unique_layers=4), "num_unique_layers"),  # a real model has L blocks
        (dict(num_unique_layers=8), "num_unique_layers"),  # k = L is the real model: share_layers=False
        (dict(num_hidden_layers=16), "num_hidden_layers"),  # the 2 blocks would run at 16 depths
        (dict(num_hidden_layers=16, share_layers=False), "num_hidden_layers"),
    ],
)
@pytest.mark.parametrize("auto", [False, True])
def test_conflicting_overrides_raise_naming_the_field(pseudo_dir, overrides, field, auto):
    path, _ = pseudo_dir
    loader = AutoModelForCausalLM if auto else P2RForCausalLM
    with pytest.raises(ValueError, match=field):
        loader.from_pretrained(path, **overrides)


def test_from_pretrained_as_real_shares_the_config(pseudo_dir, input_ids):
    path, _ = pseudo_dir
    real = P2RForCausalLM.from_pretrained(path, share_layers=False)
    assert all(layer.self_attn.config is real.config for layer in real.model.layers)
    real.set_attn_implementation("eager")
    assert {layer.self_attn.config._attn_implementation for layer in real.model.layers} == {"eager"}
    with torch.no_grad():
        assert len(real(input_ids, output_attentions=True).attentions) == 8


def _drop_weight(path, key):
    weights = load_file(path / "model.safetensors")
    del weights[key]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("overrides", [{}, dict(share_layers=False)])
@pytest.mark.parametrize("key", ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"])
def test_missing_head_norm_or_embedding_is_initialised_and_reported(tmp_path, input_ids, key, overrides):
    # transformers' contract: initialised, listed in loading_info, warned about by transformers' own load report.
    model = tiny_model(seed=2, share_layers=True, num_unique_layers=2)
    with torch.no_grad():
        for parameter in model.parameters():  # trained-looking weights: a fresh norm is all ones
            parameter.add_(torch.randn_like(parameter))
    model.save_pretrained(tmp_path)
    _drop_weight(tmp_path, key)
    with CaptureLogger(modeling_utils.logger) as captured:
        loaded, info = P2RForCausalLM.from_pretrained(tmp_path, output_loading_info=True, **overrides)
    assert info == {"missing_keys": {key}, "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert "LOAD REPORT" in captured.out and key in captured.out and "MISSING" in captured.out
    weights, stored = loaded.state_dict(), model.state_dict()
    names = model.delink_parameter_map() if overrides else {name: name for name in stored}
    assert len(weights) == len(names) and not torch.equal(weights[key], stored[key])
    assert all(torch.equal(weights[new], stored[old]) for new, old in names.items() if old != key)
    assert torch.isfinite(_logits(loaded, input_ids)).all()


@pytest.mark.parametrize("key", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"])
def test_missing_layer_weight_is_an_error(pseudo_dir, key):
    path, _ = pseudo_dir
    _drop_weight(path, key)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .* 2 blocks .*missing keys: {re.escape(key)}$"):
        P2RForCausalLM.from_pretrained(path, output_loading_info=True)


def test_state_dict_with_other_blocks_is_an_error():
    weights = tiny_model().state_dict()
    with pytest.raises(ValueError, match=r"^the state_dict: .*blocks \[0, 1, .*unexpected keys: model\.layers\.2\."):
        P2RForCausalLM.from_pretrained(
            None, config=tiny_config(share_layers=True, num_unique_layers=2), state_dict=weights
        )


def test_unexpected_non_layer_weights_are_ignored_and_reported(pseudo_dir, input_ids):
    path, model = pseudo_dir
    weights = load_file(path / "model.safetensors")
    weights["score.weight"] = torch.zeros(3, 32)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = P2RForCausalLM.from_pretrained(path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), {"score.weight"})
    assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("overrides", [{}, dict(share_layers=False)])
def test_base_checkpoint_loads_into_causal_lm(tmp_path, input_ids, tie, overrides):
    torch.manual_seed(3)
    base = P2RModel(tiny_config(share_layers=True, num_unique_layers=2, tie_word_embeddings=tie)).eval()
    base.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" in f.keys(), "a base checkpoint has no `model.` prefix"
    lm, info = P2RForCausalLM.from_pretrained(tmp_path, output_loading_info=True, **overrides)
    assert info["missing_keys"] == (set() if tie else {"lm_head.weight"}) and not info["unexpected_keys"]
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tie
    assert len(lm.model.layers) == (8 if overrides else 2)
    with torch.no_grad():
        # Mmapped weights sit at another alignment than the in-memory ones, which can change the GEMM's last bit.
        torch.testing.assert_close(lm.model(input_ids).last_hidden_state, base(input_ids).last_hidden_state)
        assert torch.isfinite(lm(input_ids).logits).all()


def test_causal_lm_checkpoint_loads_into_base_model(pseudo_dir, input_ids):
    path, model = pseudo_dir
    base, info = P2RModel.from_pretrained(path, share_layers=False, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), {"lm_head.weight"})
    assert len(base.layers) == 8
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids).last_hidden_state, model.model(input_ids).last_hidden_state)


@pytest.mark.parametrize(
    "overrides", [{}, dict(share_layers=True, num_unique_layers=2), dict(tie_word_embeddings=True)]
)
def test_empty_state_dict_initialises_every_weight_like_init(overrides, monkeypatch):
    # transformers' idiom (its test_can_init_all_missing_weights): with the same seed, every weight missing from the
    # checkpoint gets what __init__ gives it, the depth-scaled residual projections included.
    initialize = PreTrainedModel._initialize_weights

    def seeded(*args, **kwargs):
        torch.manual_seed(42)
        initialize(*args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_initialize_weights", seeded)
    config = tiny_config(**overrides)
    for cls in (P2RForCausalLM, P2RModel):
        built = cls(copy.deepcopy(config)).state_dict()
        loaded, info = cls.from_pretrained(None, config=copy.deepcopy(config), state_dict={}, output_loading_info=True)
        assert info["missing_keys"] == set(built), "all reported, the tied head too (as for Llama)"
        assert loaded.state_dict().keys() == built.keys()
        assert all(torch.equal(tensor, built[name]) for name, tensor in loaded.state_dict().items())
    if not config.share_layers:
        llama = LlamaConfig(**{key: getattr(config, key) for key in LlamaConfig().to_dict() if hasattr(config, key)})
        _, llama_info = LlamaForCausalLM.from_pretrained(None, config=llama, state_dict={}, output_loading_info=True)
        _, p2r_info = P2RForCausalLM.from_pretrained(None, config=config, state_dict={}, output_loading_info=True)
        assert p2r_info == llama_info


def test_tied_head_is_not_a_missing_weight(tmp_path, input_ids):
    model = tiny_model(share_layers=True, num_unique_layers=2, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    loaded = P2RForCausalLM.from_pretrained(tmp_path, share_layers=False)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))


@pytest.mark.parametrize(("declared", "problem"), [(4, "missing keys"), (1, "unexpected keys")])
def test_blocks_that_disagree_with_config_are_an_error(pseudo_dir, declared, problem):
    path, _ = pseudo_dir
    config = json.loads((path / "config.json").read_text())
    config["num_unique_layers"] = declared
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{path}.*{problem}"):
        P2RForCausalLM.from_pretrained(path)


def test_weights_load_from_safetensors_only(pseudo_dir):
    path, _ = pseudo_dir
    with pytest.raises(ValueError, match="safetensors only"):
        P2RForCausalLM.from_pretrained(path, use_safetensors=False)


def test_export_llama_loads_in_vanilla_transformers(tmp_path, input_ids):
    real = tiny_model(seed=4, share_layers=True, num_unique_layers=2).delink()
    out = export_llama(real, tmp_path / "llama")
    real.save_pretrained(tmp_path / "p2r")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert not {"share_layers", "num_unique_layers", "sharing_pattern"} & config.keys()
    assert not list(tmp_path.glob(".llama.tmp-*")), "the temporary folder is renamed into place"
    assert_export_matches(LlamaForCausalLM, P2RForCausalLM, out, tmp_path / "p2r", real, input_ids)


def test_export_llama_with_tied_embeddings(tmp_path, input_ids):
    real = tiny_model(seed=4, tie_word_embeddings=True)
    llama = LlamaForCausalLM.from_pretrained(export_llama(real, tmp_path / "llama"))
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    torch.testing.assert_close(_logits(llama, input_ids), _logits(real, input_ids), rtol=1e-5, atol=1e-6)


def test_export_llama_refuses_pseudo_models_and_non_empty_folders(tmp_path):
    with pytest.raises(ValueError, match="share_layers=True"):
        export_llama(tiny_model(share_layers=True), tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export_llama(tiny_model(), tmp_path / "b")
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"


@pytest.mark.versions  # transformers' remote-code loading, on the floors and the newest releases too
def test_remote_code_folder_loads_without_hf_p2r(tmp_path, input_ids):
    model = tiny_model(seed=6, share_layers=True, num_unique_layers=2)
    folder = tmp_path / "remote"
    model.save_pretrained(folder, remote_code=True)
    assert {"configuration_p2r.py", "modeling_p2r.py"} <= set(os.listdir(folder))
    assert json.loads((folder / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_p2r.P2RConfig",
        "AutoModelForCausalLM": "modeling_p2r.P2RForCausalLM",
    }
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    assert "auto_map" not in json.loads((plain / "config.json").read_text()), "remote code is per save, not global"

    module, pseudo_layers, real_layers = load_as_remote_code(model, folder, input_ids, tmp_path)
    assert module.startswith("transformers_modules.") and (pseudo_layers, real_layers) == (2, 8)


def test_delink_on_load_refuses_tensor_parallel_loading(pseudo_dir):
    path, _ = pseudo_dir
    with pytest.raises(ValueError, match="hf-p2r convert"):
        P2RForCausalLM.from_pretrained(path, share_layers=False, tp_plan="auto")
