"""The streaming converter on mixture-of-experts checkpoints: planned from headers (experts as transformers writes
Mixtral's, one tensor per expert and projection), written without torch, equal to what transformers itself writes."""

import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from hf_p2r import convert_pseudo_to_real
from hf_p2r.checkpoint.mixtral import export_mixtral, mixtral_fields
from hf_p2r.checkpoint.source import parameter_shapes, read_p2r_config
from hf_p2r.cli import main
from hf_p2r.models.p2r.configuration_p2r_moe import P2RMoeConfig
from hf_p2r.models.p2r.inventory_p2r import MOE_DEFAULTS
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM
from hf_p2r.models.p2r.sharing_p2r import delink_names, delink_sources

from ..conftest import tiny_model
from ..models.test_modeling_p2r_moe import moe_config, moe_model
from .test_convert import _assert_same_weights, _logits

LAYOUTS = {
    "k=1": dict(num_unique_layers=1),
    "k=2, every 2nd sparse": dict(num_unique_layers=2, decoder_sparse_step=2),
    "prototyping, tied, biases": dict(
        num_unique_layers=2, num_experts=6, num_experts_per_tok=3, num_expert_groups=3, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True,
    ),
    "sequence, dense depths 0-1": dict(num_unique_layers=4, sharing_pattern="sequence", mlp_only_layers=[0, 1]),
}  # fmt: skip


def _pseudo(tmp_path, seed=0, **overrides):
    model = moe_model(seed=seed, **(dict(share_layers=True, num_unique_layers=2) | overrides))
    model.save_pretrained(tmp_path / "pseudo")
    return tmp_path / "pseudo", model


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fields", LAYOUTS.values(), ids=LAYOUTS)
def test_plan_is_what_save_pretrained_writes(fields):
    """Names, shapes and order of the planned tensors (pseudo and delinked) are those transformers writes for the model
    built on the meta device; the delink map of the plan is the model's."""
    config = moe_config(share_layers=True, **fields)
    as_json, k = json.loads(config.to_json_string()), config.num_unique_layers
    for new_k in (k, 4, 8) if k < 4 else (k, 8):
        with torch.device("meta"):
            model = P2RMoeForCausalLM(moe_config(share_layers=True, **fields))
            if new_k != k:
                model.delink(new_k if new_k < 8 else None)
        tied = model.all_tied_weights_keys
        saved = revert_weight_conversion(model, {n: t for n, t in model.state_dict().items() if n not in tied})
        assert list(parameter_shapes(as_json, new_k).items()) == [(n, tuple(t.shape)) for n, t in saved.items()]
    delinked = delink_names(parameter_shapes(as_json, k), delink_sources(8, k, 8, config.sharing_pattern))
    assert delinked.keys() == parameter_shapes(as_json, 8).keys()


@pytest.mark.parametrize("fields", LAYOUTS.values(), ids=LAYOUTS)
def test_conversion_is_from_pretrained_real_saved(tmp_path, input_ids, fields):
    """The output is `from_pretrained(pseudo, share_layers=False).save_pretrained(...)`, byte for byte, and loads."""
    src, model = _pseudo(tmp_path, **fields)
    out = convert_pseudo_to_real(src, tmp_path / "out", verify=True, progress=False)
    real = P2RMoeForCausalLM.from_pretrained(src, share_layers=False)
    real.save_pretrained(tmp_path / "reference")
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "reference" / "model.safetensors")
    loaded = P2RMoeForCausalLM.from_pretrained(out)
    assert (loaded.config.share_layers, loaded.config.num_unique_layers) == (False, 8)
    _assert_same_weights(loaded, real)
    _assert_same_weights(loaded, model.delink())
    assert torch.equal(_logits(loaded, input_ids), _logits(real, input_ids))


def test_partial_delink_sharded_and_cast(tmp_path, input_ids):
    src, model = _pseudo(tmp_path, seed=1)
    out = convert_pseudo_to_real(src, tmp_path / "out", num_unique_layers=4, max_shard_size="20KB", verify=True)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    loaded = P2RMoeForCausalLM.from_pretrained(out)
    assert (loaded.config.share_layers, loaded.config.num_unique_layers) == (True, 4)
    _assert_same_weights(loaded, model.delink(4))
    cast = convert_pseudo_to_real(src, tmp_path / "bf16", dtype="bfloat16", verify=True, progress=False)
    real = model.delink().to(torch.bfloat16)  # delink() works in place: from 4 blocks now
    _assert_same_weights(P2RMoeForCausalLM.from_pretrained(cast, dtype=torch.bfloat16), real)


def test_mixtral_target_loads_in_vanilla_transformers(tmp_path, capsys, input_ids):
    src, model = _pseudo(tmp_path, seed=2)
    assert main(["convert", str(src), str(tmp_path / "mixtral"), "--target", "mixtral", "--verify"]) == 0
    out = tmp_path / "mixtral"
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert not {"share_layers", "num_unique_layers", "num_experts", "sharing_pattern", "auto_map"} & config.keys()
    mixtral = MixtralForCausalLM.from_pretrained(out)
    real = P2RMoeForCausalLM.from_pretrained(src, share_layers=False)
    assert torch.equal(_logits(mixtral, input_ids), _logits(real, input_ids))
    # the same weights file, and the same config, as export_mixtral of the delinked model in memory
    exported = export_mixtral(model.delink(), tmp_path / "exported", progress=False)
    assert _sha(out / "model.safetensors") == _sha(exported / "model.safetensors")
    assert {k: v for k, v in json.loads((exported / "config.json").read_text()).items() if k in config} == config


def test_mixtral_fields_default_as_p2r_does(tmp_path, input_ids):
    """A config.json that leaves fields out (P2R's defaults differ from Mixtral's: rms_norm_eps, rope_theta, ...)."""
    assert mixtral_fields({}) == mixtral_fields(P2RMoeConfig().to_dict())
    assert MOE_DEFAULTS == {field: P2RMoeConfig.__dataclass_fields__[field].default for field in MOE_DEFAULTS}
    src, model = _pseudo(tmp_path, seed=3, num_key_value_heads=4)
    config = json.loads((src / "config.json").read_text())
    kept = ("model_type", "share_layers", "num_unique_layers", "vocab_size", "hidden_size", "intermediate_size")
    kept += ("num_hidden_layers", "num_attention_heads", "num_experts", "moe_intermediate_size", "pad_token_id")
    (src / "config.json").write_text(json.dumps({key: config[key] for key in kept}))
    out = convert_pseudo_to_real(src, tmp_path / "mixtral", target="mixtral", progress=False)
    mixtral = MixtralForCausalLM.from_pretrained(out)
    real = P2RMoeForCausalLM.from_pretrained(src, share_layers=False)
    assert real.config.num_key_value_heads == 4 and real.config.rms_norm_eps == 1e-6
    assert torch.equal(_logits(mixtral, input_ids), _logits(real, input_ids))


def test_conversion_does_not_import_torch(tmp_path):
    src, _ = _pseudo(tmp_path, seed=4)
    shutil.copytree(src, tmp_path / "fused")
    _fused(tmp_path / "fused")
    code = f"""
import sys
from hf_p2r.cli import main
assert main(["convert", {str(src)!r}, {str(tmp_path / "m")!r}, "--target", "mixtral"]) == 0
assert main(["convert", {str(src)!r}, {str(tmp_path / "p")!r}, "--num-unique-layers", "4"]) == 0
assert main(["convert", {str(tmp_path / "fused")!r}, {str(tmp_path / "f")!r}]) == 0
print("torch" in sys.modules, "transformers" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-2:] == ["False", "False"]


def _fused(src):
    """The same pseudo model saved as its state dict (3-D experts, in-memory names), not as transformers saves it."""
    model = P2RMoeForCausalLM.from_pretrained(src)
    save_file(model.state_dict(), src / "model.safetensors", metadata={"format": "pt"})


def test_3d_experts_on_disk_are_split_into_experts(tmp_path, input_ids):
    """A checkpoint holding the in-memory layout (3-D experts, which from_pretrained loads too) converts to Mixtral's
    layout, what save_pretrained writes for a model built in memory: each expert's w1/w3/w2 are byte ranges of the 3-D
    tensors. The cast and verify paths (torch) read the same views."""
    src, model = _pseudo(tmp_path, seed=7, num_unique_layers=1)
    _fused(src)
    with safe_open(src / "model.safetensors", "pt") as file:
        assert "model.layers.0.mlp.experts.gate_up_proj" in file.keys(), "the control: the source is 3-D"
    out = convert_pseudo_to_real(src, tmp_path / "out", verify=True, progress=False)
    with safe_open(out / "model.safetensors", "pt") as file:
        assert "model.layers.7.block_sparse_moe.experts.3.w2.weight" in file.keys(), "Mixtral's layout"
    # transformers saves a model in the layout it was loaded from: tensors equal, names not
    real = P2RMoeForCausalLM.from_pretrained(src, share_layers=False)
    _assert_same_weights(P2RMoeForCausalLM.from_pretrained(out), real)
    real.save_pretrained(tmp_path / "reference")
    _assert_same_weights(P2RMoeForCausalLM.from_pretrained(tmp_path / "reference"), real)
    model.delink().save_pretrained(tmp_path / "built")  # a model built in memory is saved in Mixtral's layout
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "built" / "model.safetensors")
    model = moe_model(seed=7, share_layers=True, num_unique_layers=1)
    partial = convert_pseudo_to_real(src, tmp_path / "k4", num_unique_layers=4, progress=False)
    _assert_same_weights(P2RMoeForCausalLM.from_pretrained(partial), copy.deepcopy(model).delink(4))
    cast = convert_pseudo_to_real(src, tmp_path / "f16", dtype="float16", verify=True, progress=False)
    _assert_same_weights(P2RMoeForCausalLM.from_pretrained(cast, dtype=torch.float16), real.to(torch.float16))
    mixtral = MixtralForCausalLM.from_pretrained(convert_pseudo_to_real(src, tmp_path / "m", target="mixtral"))
    assert torch.equal(_logits(mixtral, input_ids), _logits(model.delink(), input_ids))


def _edit_config(**fields):
    def edit(src):
        path = src / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))

    return edit


BAD = {
    "prototyping to mixtral": (
        dict(num_experts=6, num_experts_per_tok=3, num_expert_groups=3),
        ["--target", "mixtral"],
        None,
        r"pseudo/config.json: num_expert_groups=3 \(expert prototyping.*no Mixtral equivalent",
    ),
    "dense layers to mixtral": (
        dict(decoder_sparse_step=2),
        ["--target", "mixtral"],
        None,
        r"pseudo/config.json: dense layers \(decoder_sparse_step=2, .*no Mixtral equivalent",
    ),
    "moe to llama": ({}, ["--target", "llama"], None, r"model_type is 'p2r_moe' .*target='llama' is for dense"),
    "partial to mixtral": ({}, ["--target", "mixtral", "--num-unique-layers", "4"], None, "needs the real model"),
    "top-k over experts": ({}, [], _edit_config(num_experts_per_tok=5), r"config.json: num_experts_per_tok \(5\)"),
    "bad mlp_only_layers": ({}, [], _edit_config(mlp_only_layers=[9]), r"config.json: mlp_only_layers must list"),
    "sparse disagrees with sharing": (
        {},
        [],
        _edit_config(decoder_sparse_step=2, num_unique_layers=1),
        r"config.json: decoder_sparse_step=2 .* make block 0 sparse at some depths and dense at others",
    ),
    "bad flag": ({}, [], _edit_config(norm_topk_prob="yes"), "config.json: norm_topk_prob must be true or false"),
    "experts mismatch": (
        {},
        [],
        _edit_config(num_experts=8),
        r"pseudo: missing tensors that .*config.json requires: model.layers.0.block_sparse_moe.experts.4.w1",
    ),
    "expert size mismatch": (
        {},
        [],
        _edit_config(moe_intermediate_size=40),
        r"model.safetensors: model.layers.0.block_sparse_moe.experts.0.w2.weight has shape \[32, 48\] but",
    ),
    "3-D experts of another size": (
        {},
        [],
        lambda src: (_fused(src), _edit_config(moe_intermediate_size=40)(src)),
        r"model.safetensors: model.layers.0.mlp.experts.down_proj has shape \[4, 32, 48\] but .*config.json implies "
        r"\[4, 32, 40\]",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=BAD)
def test_bad_input_is_one_line_and_no_dst(tmp_path, capsys, case):
    fields, args, damage, message = BAD[case]
    src, _ = _pseudo(tmp_path, **fields)
    if damage is not None:
        damage(src)
    code = main(["convert", str(src), str(tmp_path / "out"), *args])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err, err
    assert err.startswith("hf-p2r convert: error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_dense_checkpoint_to_mixtral_is_refused(tmp_path, capsys):
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path / "dense")
    assert main(["convert", str(tmp_path / "dense"), str(tmp_path / "out"), "--target", "mixtral"]) == 2
    err = capsys.readouterr().err
    assert "model_type is 'p2r' (a dense model, no experts): target='mixtral' is for MoE models" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_remote_code_is_carried(tmp_path, input_ids):
    src, model = _pseudo(tmp_path, seed=5)
    model.save_pretrained(src, remote_code=True)
    out = convert_pseudo_to_real(src, tmp_path / "out", progress=False)
    code = sorted(p.name for p in src.glob("*.py"))
    assert "modeling_p2r_moe.py" in code and "sharing_p2r.py" in code  # what loads without hf_p2r (tests/models)
    assert {name: _sha(out / name) for name in code} == {name: _sha(src / name) for name in code}
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_p2r_moe.P2RMoeForCausalLM"
    )
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert torch.equal(_logits(loaded, input_ids), _logits(model.delink(), input_ids))


def test_read_p2r_config_gives_the_moe_config(tmp_path):
    src, model = _pseudo(tmp_path, seed=6, decoder_sparse_step=2)
    config = read_p2r_config(src)
    assert type(config) is P2RMoeConfig and config.to_dict() == model.config.to_dict()
