import pytest
import torch

from hf_p2r import P2RModel

from ..conftest import tiny_config, tiny_model


@pytest.mark.parametrize(("k", "pattern"), [(1, "cycle"), (2, "cycle"), (3, "cycle"), (2, "sequence"), (3, "sequence")])
def test_full_delink_is_bitwise_function_preserving(k, pattern, input_ids):
    model = tiny_model(share_layers=True, num_unique_layers=k, sharing_pattern=pattern)
    with torch.no_grad():
        before = model(input_ids).logits
        assert model.delink() is model
        after = model(input_ids).logits
    assert torch.equal(before, after)
    assert (model.config.share_layers, model.config.num_unique_layers) == (False, 8)
    assert len(model.model.layers) == 8
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(8))
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(pointers) == len(set(pointers)), "delinked blocks must not share storage"


def test_partial_delink_chain_1_4_16(input_ids):
    model = tiny_model(num_hidden_layers=16, share_layers=True, num_unique_layers=1)
    with torch.no_grad():
        reference = model(input_ids).logits
        model.delink(4)
        assert (model.config.share_layers, model.config.num_unique_layers, len(model.model.layers)) == (True, 4, 4)
        assert torch.equal(model(input_ids).logits, reference)
        model.delink(16)
        assert (model.config.share_layers, len(model.model.layers)) == (False, 16)
        assert torch.equal(model(input_ids).logits, reference)


def test_delinked_blocks_train_independently(input_ids):
    model = tiny_model(share_layers=True, num_unique_layers=1).train().delink()
    model(input_ids, labels=input_ids).loss.backward()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight -= model.model.layers[0].mlp.up_proj.weight.grad
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


@pytest.mark.parametrize(("k", "new"), [(2, 3), (4, 2)])
def test_invalid_partial_delink_raises_and_leaves_model_unchanged(k, new):
    model = tiny_model(share_layers=True, num_unique_layers=k)
    with pytest.raises(ValueError, match="num_unique_layers"):
        model.delink(new)
    assert (model.config.num_unique_layers, len(model.model.layers)) == (k, k)


def test_delink_real_model_raises():
    with pytest.raises(ValueError, match="already real"):
        tiny_model().delink()


def test_delink_keeps_dtype_device_and_requires_grad(input_ids):
    model = tiny_model(share_layers=True, num_unique_layers=2).to(torch.bfloat16)
    model.model.layers[1].mlp.requires_grad_(False)
    model.delink()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    for depth, layer in enumerate(model.model.layers):
        assert all(p.requires_grad == (depth % 2 == 0) for p in layer.mlp.parameters())
        assert all(p.requires_grad for p in layer.self_attn.parameters())


def test_parameter_map_names_every_new_parameter_and_its_source():
    model = tiny_model(num_hidden_layers=8, share_layers=True, num_unique_layers=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    mapping = model.delink_parameter_map(4)
    assert model.config.num_unique_layers == 2, "the map must not change the model"
    assert mapping["model.layers.3.mlp.up_proj.weight"] == "model.layers.1.mlp.up_proj.weight"
    assert mapping["model.layers.2.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert mapping["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    model.delink(4)
    after = dict(model.named_parameters())
    assert mapping.keys() == after.keys()
    for new, old in mapping.items():
        assert torch.equal(after[new], before[old])


def test_first_copy_keeps_the_parameter_objects():
    """The first depth of each block keeps the original Parameter objects, so references to them stay valid."""
    model = tiny_model(share_layers=True, num_unique_layers=2)
    original = model.model.layers[1].self_attn.q_proj.weight
    model.delink()
    assert model.model.layers[1].self_attn.q_proj.weight is original
    assert model.model.layers[3].self_attn.q_proj.weight is not original


def test_base_model_delinks_too(input_ids):
    torch.manual_seed(0)
    model = P2RModel(tiny_config(share_layers=True, num_unique_layers=2)).eval()
    assert model.delink_parameter_map()["layers.5.input_layernorm.weight"] == "layers.1.input_layernorm.weight"
    with torch.no_grad():
        before = model(input_ids).last_hidden_state
        after = model.delink()(input_ids).last_hidden_state
    assert torch.equal(before, after)


def test_delinked_blocks_share_the_model_config(input_ids):
    """Copies made by delink read the model's config, so `set_attn_implementation` reaches every depth."""
    model = tiny_model(share_layers=True, num_unique_layers=2).delink()
    for layer in model.model.layers:
        assert layer.self_attn.config is model.config and layer.mlp.config is model.config
    model.set_attn_implementation("eager")
    assert [layer.self_attn.config._attn_implementation for layer in model.model.layers] == ["eager"] * 8
    with torch.no_grad():
        attentions = model(input_ids, output_attentions=True).attentions
    assert len(attentions) == 8 and all(a.shape == (2, 4, 12, 12) for a in attentions)
