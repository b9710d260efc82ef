import json

import pytest
import torch
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM

from hf_p2r.checkpoint.mixtral import export_mixtral, mixtral_config
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM

from ..models.helpers import assert_export_matches
from ..models.test_modeling_p2r_moe import moe_model


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def _keys(folder):
    with safe_open(folder / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_export_mixtral_loads_in_vanilla_transformers(tmp_path, input_ids):
    real = moe_model(seed=4, share_layers=True, num_unique_layers=2).delink()
    out = export_mixtral(real, tmp_path / "mixtral", progress=False)
    real.save_pretrained(tmp_path / "p2r")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert not {"share_layers", "num_unique_layers", "num_experts", "auto_map"} & config.keys()
    assert (config["num_local_experts"], config["intermediate_size"]) == (4, 48)
    # The names transformers itself writes for a Mixtral of these dims.
    MixtralForCausalLM(MixtralConfig.from_dict(config)).save_pretrained(tmp_path / "vanilla")
    assert _keys(out) == _keys(tmp_path / "vanilla")
    loaded = assert_export_matches(MixtralForCausalLM, P2RMoeForCausalLM, out, tmp_path / "p2r", real, input_ids)
    for mixtral, p2r in loaded:
        assert mixtral.config._experts_implementation == p2r.config._experts_implementation == "grouped_mm"
    aux = mixtral(input_ids, output_router_logits=True).aux_loss
    torch.testing.assert_close(aux, real(input_ids, output_router_logits=True).aux_loss)


def test_export_mixtral_with_tied_embeddings(tmp_path, input_ids):
    real = moe_model(seed=5, tie_word_embeddings=True)
    mixtral = MixtralForCausalLM.from_pretrained(export_mixtral(real, tmp_path / "mixtral", progress=False))
    assert mixtral.lm_head.weight is mixtral.model.embed_tokens.weight
    torch.testing.assert_close(_logits(mixtral, input_ids), _logits(real, input_ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(share_layers=True, num_unique_layers=2), "share_layers"),
        (dict(num_experts=6, num_experts_per_tok=3, num_expert_groups=3), "num_expert_groups"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step"),
        (dict(mlp_only_layers=[0]), "mlp_only_layers"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_models_without_a_mixtral_equivalent_are_refused_in_one_line(tmp_path, overrides, field):
    model = moe_model(**overrides)
    with pytest.raises(ValueError, match=field) as error:
        export_mixtral(model, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_mixtral_config_keeps_the_dims():
    config = mixtral_config(moe_model(rms_norm_eps=1e-5, head_dim=16).config)
    assert (config.head_dim, config.rms_norm_eps, config.num_experts_per_tok, config.bos_token_id) == (16, 1e-5, 2, 1)
