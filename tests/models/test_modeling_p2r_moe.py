import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import hf_p2r
from hf_p2r import P2RForCausalLM
from hf_p2r.checkpoint import save_model
from hf_p2r.models.p2r.configuration_p2r_moe import P2RMoeConfig
from hf_p2r.models.p2r.modeling_p2r_moe import (
    P2RMoeExperts,
    P2RMoeForCausalLM,
    P2RMoeModel,
    P2RMoeTopKRouter,
    expert_load,
    router_aux_loss,
)

from .helpers import load_as_remote_code


def moe_config(**overrides) -> P2RMoeConfig:
    """`tiny_config`'s model with 4 experts (top-2) in every layer."""
    fields = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4)
    fields.update(num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    fields.update(overrides)
    return P2RMoeConfig(**fields)


def moe_model(seed: int = 0, **overrides) -> P2RMoeForCausalLM:
    torch.manual_seed(seed)
    return P2RMoeForCausalLM(moe_config(**overrides)).eval()


def routed(model, input_ids, **kwargs):
    """Logits and, per router call (= per sparse depth, in order), the routing weights and selected experts."""
    calls = []
    hooks = [
        module.register_forward_hook(lambda module, args, out: calls.append((out[1], out[2])))
        for module in model.modules()
        if isinstance(module, P2RMoeTopKRouter)
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids, **kwargs).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, calls


LAYOUTS = [
    dict(share_layers=True, num_unique_layers=1),
    dict(share_layers=True, num_unique_layers=2),
    dict(share_layers=True, num_unique_layers=2, sharing_pattern="sequence"),
    dict(share_layers=True, num_unique_layers=2, decoder_sparse_step=2),
    dict(share_layers=True, num_unique_layers=4, sharing_pattern="sequence", mlp_only_layers=[0, 1]),
    dict(share_layers=True, num_unique_layers=2, num_experts=6, num_experts_per_tok=3, num_expert_groups=3),
    dict(share_layers=True, num_unique_layers=1, norm_topk_prob=False),
]


def test_config_defaults_and_sparse_blocks():
    config = P2RMoeConfig(num_hidden_layers=8, intermediate_size=64, num_experts=4)
    assert (config.moe_intermediate_size, config.mlp_only_layers, config.num_expert_groups) == (64, [], 1)
    assert config.sparse_depths == [True] * 8 and config.sparse_blocks == [True] * 8
    config = moe_config(share_layers=True, num_unique_layers=2, decoder_sparse_step=2)
    assert config.sparse_depths == [False, True] * 4 and config.sparse_blocks == [False, True]
    config = moe_config(share_layers=True, num_unique_layers=4, sharing_pattern="sequence", mlp_only_layers=[6, 7])
    assert config.sparse_blocks == [True, True, True, False]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(num_expert_groups=0), "num_expert_groups"),
        (dict(num_expert_groups=3, num_experts_per_tok=3), "num_expert_groups"),
        (dict(num_expert_groups=2, num_experts_per_tok=1), "num_expert_groups"),
        (dict(mlp_only_layers=[8]), "mlp_only_layers"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
        (dict(mlp_only_layers=list(range(8))), "no layer is sparse"),
        (dict(share_layers=True, num_unique_layers=1, decoder_sparse_step=2), "decoder_sparse_step"),
        (dict(share_layers=True, num_unique_layers=2, mlp_only_layers=[0]), "mlp_only_layers"),
        (dict(share_layers=True, num_unique_layers=8), "num_unique_layers"),
    ],
)
def test_invalid_configs_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        moe_config(**overrides)


def test_fields_assigned_after_construction_are_checked_by_the_model():
    config = moe_config()
    config.num_experts_per_tok = 7
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        P2RMoeForCausalLM(config)


def test_pseudo_stores_k_blocks_each_with_router_and_3d_experts():
    P2RForCausalLM._can_set_experts_implementation()  # the dense parent's answer (False) must not carry over
    model = moe_model(share_layers=True, num_unique_layers=2, decoder_sparse_step=2)
    assert len(model.model.layers) == 2
    dense, sparse = model.model.layers
    assert not any(isinstance(m, P2RMoeExperts) for m in dense.modules())
    assert sparse.mlp.gate.weight.shape == (4, 32)
    assert sparse.mlp.experts.gate_up_proj.shape == (4, 96, 32)
    assert sparse.mlp.experts.down_proj.shape == (4, 32, 48)
    assert model.config._experts_implementation == "grouped_mm", "transformers' kernels run the experts"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_delink_keeps_every_depths_routing_and_logits_bitwise(layout, input_ids):
    model = moe_model(seed=1, **layout)
    logits, routing = routed(model, input_ids)
    assert len(routing) == sum(model.config.sparse_depths), "one routing per sparse depth"
    assert len({tuple(indices.flatten().tolist()) for _, indices in routing}) > 1, "depths route differently"
    model.delink()
    assert (model.config.share_layers, len(model.model.layers)) == (False, 8)
    logits_after, routing_after = routed(model, input_ids)
    assert torch.equal(logits, logits_after)
    assert len(routing_after) == len(routing)
    for (weights, indices), (weights_after, indices_after) in zip(routing, routing_after):
        assert torch.equal(indices, indices_after)
        assert torch.equal(weights, weights_after)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(pointers) == len(set(pointers)), "delinked routers and experts must not share storage"


def test_partial_delink_chain_keeps_routing(input_ids):
    model = moe_model(seed=2, num_hidden_layers=16, share_layers=True, num_unique_layers=1)
    logits, routing = routed(model, input_ids)
    for k in (4, 16):
        model.delink(k if k < 16 else None)
        logits_after, routing_after = routed(model, input_ids)
        assert torch.equal(logits, logits_after)
        assert all(
            torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(routing, routing_after, strict=True)
        )
    assert len(model.model.layers) == 16


def test_parameter_map_covers_routers_and_experts():
    model = moe_model(share_layers=True, num_unique_layers=2)
    mapping = model.delink_parameter_map()
    assert mapping["model.layers.5.mlp.experts.gate_up_proj"] == "model.layers.1.mlp.experts.gate_up_proj"
    assert mapping["model.layers.6.mlp.gate.weight"] == "model.layers.0.mlp.gate.weight"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    after = dict(model.delink().named_parameters())
    assert mapping.keys() == after.keys()
    assert all(torch.equal(after[new], before[old]) for new, old in mapping.items())


@pytest.mark.parametrize("layout", LAYOUTS[:3] + LAYOUTS[5:6])
def test_pseudo_cached_generation_equals_uncached(layout, input_ids):
    model = moe_model(seed=3, **layout)
    prompt = input_ids[:, :5]
    cached = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, use_cache=False)
    assert cached.shape == (2, 15)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[3], LAYOUTS[5]])
def test_aux_loss_has_one_term_per_depth_and_survives_delink(layout, input_ids):
    model = moe_model(seed=4, router_aux_loss_coef=0.1, **layout)
    out = model(input_ids, labels=input_ids, output_router_logits=True)
    assert len(out.router_logits) == sum(model.config.sparse_depths)
    if model.config.num_expert_groups == 1:
        expected = load_balancing_loss_func(out.router_logits, 4, 2)
        assert torch.equal(out.aux_loss, expected)
    # A shared router used at n depths contributes n terms: the per-depth sum, not one term per stored block.
    one_per_block = router_aux_loss(out.router_logits[: model.config.num_blocks], model.config)
    assert not torch.equal(out.aux_loss, one_per_block)
    plain = model(input_ids, labels=input_ids).loss
    assert torch.equal(out.loss, plain + 0.1 * out.aux_loss)
    model.delink()
    delinked = model(input_ids, labels=input_ids, output_router_logits=True)
    assert torch.equal(delinked.aux_loss, out.aux_loss) and torch.equal(delinked.loss, out.loss)


def test_aux_loss_backpropagates_into_the_shared_router(input_ids):
    model = moe_model(share_layers=True, num_unique_layers=1).train()
    model(input_ids, output_router_logits=True).aux_loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_with_padding_and_cached_generation(input_ids):
    model = moe_model(share_layers=True, num_unique_layers=2, output_router_logits=True)
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    out = model(input_ids, attention_mask=mask)
    assert torch.equal(out.aux_loss, load_balancing_loss_func(out.router_logits, 4, 2, mask))
    generated = model.generate(input_ids[:, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 9)


def test_expert_prototyping_takes_the_top_1_of_every_group(input_ids):
    model = moe_model(num_experts=6, num_experts_per_tok=3, num_expert_groups=3, norm_topk_prob=False)
    _, routing = routed(model, input_ids)
    for weights, indices in routing:
        assert torch.equal(indices // 2, torch.arange(3).expand_as(indices)), "one expert from each group"
        assert ((weights >= 0.5) & (weights <= 1)).all(), "top-1 of two experts: probability at least 1/2"
    normed = moe_model(num_experts=6, num_experts_per_tok=3, num_expert_groups=3)
    _, routing = routed(normed, input_ids)
    torch.testing.assert_close(routing[0][0].sum(-1), torch.ones(24))


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[5]])
def test_expert_load_is_the_routers_choice_averaged_over_depths(layout, input_ids):
    model = moe_model(seed=9, **layout)
    out = model(input_ids, output_router_logits=True)
    load = expert_load(out.router_logits, model.config)
    _, routing = routed(model, input_ids)
    num_experts = model.config.num_experts
    counts = [torch.bincount(indices.flatten(), minlength=num_experts) / indices.numel() for _, indices in routing]
    assert torch.equal(load, torch.stack(counts).mean(0))
    torch.testing.assert_close(load.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_experts_implementations_agree(impl, input_ids):
    model = moe_model(seed=5, share_layers=True, num_unique_layers=2)
    reference = routed(model, input_ids)[0]
    model.set_experts_implementation(impl)
    assert model.config._experts_implementation == impl
    torch.testing.assert_close(routed(model, input_ids)[0], reference, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_keeps_loss_and_gradients(input_ids):
    model = moe_model(seed=6, share_layers=True, num_unique_layers=2).train()
    model(input_ids, labels=input_ids, output_router_logits=True).loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(input_ids, labels=input_ids, output_router_logits=True).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7)


# Checkpoints


@pytest.fixture
def moe_pseudo_dir(tmp_path):
    model = moe_model(seed=7, share_layers=True, num_unique_layers=2, decoder_sparse_step=2)
    model.save_pretrained(tmp_path / "pseudo")
    return tmp_path / "pseudo", model


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("writer", ["save_pretrained", "save_model"])
def test_checkpoint_has_mixtral_names_on_disk(moe_pseudo_dir, tmp_path, writer):
    path, model = moe_pseudo_dir
    if writer == "save_model":  # hf-p2r's own writer (the trainer's saves, the exports) writes the same names
        path = save_model(model, tmp_path / "saved", progress=False)
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.gate.weight" in keys
    assert {f"model.layers.1.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)} <= keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys, "dense layers keep Llama's names"
    assert {key.split(".")[2] for key in keys if ".layers." in key} == {"0", "1"}, "a pseudo model stores k blocks"
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["share_layers"]) == ("p2r_moe", True)


def test_from_pretrained_round_trip_and_as_real(moe_pseudo_dir, input_ids):
    path, model = moe_pseudo_dir
    reference, routing = routed(model, input_ids)
    pseudo = P2RMoeForCausalLM.from_pretrained(path)
    assert (pseudo.config.share_layers, len(pseudo.model.layers)) == (True, 2)
    assert torch.equal(_logits(pseudo, input_ids), reference)
    real = P2RMoeForCausalLM.from_pretrained(path, share_layers=False)
    assert (real.config.share_layers, len(real.model.layers)) == (False, 8)
    logits, routing_real = routed(real, input_ids)
    assert torch.equal(logits, reference)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(routing, routing_real, strict=True))
    partial = P2RMoeForCausalLM.from_pretrained(path, num_unique_layers=4)
    assert len(partial.model.layers) == 4 and torch.equal(_logits(partial, input_ids), reference)


def test_auto_classes_know_p2r_moe(moe_pseudo_dir, input_ids):
    path, model = moe_pseudo_dir
    real = AutoModelForCausalLM.from_pretrained(path, share_layers=False)
    assert type(real) is P2RMoeForCausalLM and len(real.model.layers) == 8
    assert torch.equal(_logits(real, input_ids), _logits(model, input_ids))
    config = AutoConfig.for_model("p2r_moe", num_hidden_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=50)
    assert type(config) is P2RMoeConfig and type(AutoModel.from_config(config)) is P2RMoeModel
    assert hf_p2r.P2RMoeForCausalLM is P2RMoeForCausalLM


def test_fused_expert_layout_loads_too(moe_pseudo_dir, tmp_path, input_ids):
    """Checkpoints written from the state dict as it is in memory (3-D experts) load as well."""
    path, model = moe_pseudo_dir
    (tmp_path / "fused").mkdir()
    shutil.copy(path / "config.json", tmp_path / "fused")
    save_file(model.state_dict(), tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    loaded = P2RMoeForCausalLM.from_pretrained(tmp_path / "fused", share_layers=False)
    assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))


def test_mismatched_checkpoint_is_one_error(moe_pseudo_dir):
    path, _ = moe_pseudo_dir
    with pytest.raises(ValueError, match="mlp_only_layers|decoder_sparse_step"):
        P2RMoeForCausalLM.from_pretrained(path, share_layers=False, decoder_sparse_step=1, mlp_only_layers=[1])


def test_remote_code_folder_loads_without_hf_p2r(tmp_path, input_ids):
    model = moe_model(seed=8, share_layers=True, num_unique_layers=2)
    folder = tmp_path / "remote"
    model.save_pretrained(folder, remote_code=True)
    assert {"configuration_p2r_moe.py", "modeling_p2r_moe.py", "modeling_p2r.py"} <= set(os.listdir(folder))
    assert json.loads((folder / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_p2r_moe.P2RMoeConfig",
        "AutoModelForCausalLM": "modeling_p2r_moe.P2RMoeForCausalLM",
    }
    module, pseudo_layers, real_layers = load_as_remote_code(model, folder, input_ids, tmp_path)
    assert module.startswith("transformers_modules.") and (pseudo_layers, real_layers) == (2, 8)


def test_base_model_forward_shows_the_dense_signature():
    """transformers reads the forward's parameters (its main input, `inputs_embeds`, the cache argument)."""
    import inspect

    from hf_p2r import P2RModel, P2RMoeModel

    assert inspect.signature(P2RMoeModel.forward) == inspect.signature(P2RModel.forward)
    assert list(inspect.signature(P2RMoeModel.forward).parameters)[1] == P2RMoeModel.main_input_name
