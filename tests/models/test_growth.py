"""Shallow stages and depth growth (a delink along the depths), function-preserving growth, Depth-µP, and the FLOPs of
the depth a model runs."""

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from hf_p2r import P2RConfig, P2RForCausalLM
from hf_p2r.models.p2r import delink_sources, plan_delink, source_depths
from hf_p2r.models.p2r.inventory_p2r import inventory
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM
from hf_p2r.models.p2r.sharing_p2r import LAYER_KEY, RESIDUAL_OUTPUT

from ..conftest import tiny_config, tiny_model
from .test_modeling_p2r_moe import moe_config, moe_model


def _layer(name: str) -> tuple[int, str] | None:
    match = LAYER_KEY.match(name)
    return (int(match["block"]), match["rest"]) if match else None


def _layout(config) -> tuple:
    return config.num_hidden_layers, config.num_unique_layers, config.share_layers, config.real_num_hidden_layers


def _loss(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, labels=input_ids).loss


# The config of a shallow stage.


def test_a_shallow_config_runs_its_depth_and_records_the_real_one(tmp_path):
    config = tiny_config(num_hidden_layers=2, real_num_hidden_layers=8)
    assert (config.num_hidden_layers, config.real_depth, config.num_blocks, config.share_layers) == (2, 8, 2, False)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["num_hidden_layers"], saved["real_num_hidden_layers"]) == (2, 8)
    assert P2RConfig.from_pretrained(tmp_path).real_depth == 8


def test_a_config_at_its_real_depth_records_none(tmp_path):
    """The real depth is recorded only for a shallow model (None otherwise, written as transformers writes it)."""
    assert tiny_config(real_num_hidden_layers=8).real_num_hidden_layers is None  # equal to the depth: not shallow
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["real_num_hidden_layers"], saved["depth_mup"]) == (None, False)


@pytest.mark.parametrize("real", [1, 0, 10_001])
def test_a_real_depth_below_the_depth_or_out_of_bounds_is_refused_naming_it(real):
    with pytest.raises(ValueError, match="real_num_hidden_layers"):
        tiny_config(num_hidden_layers=2, real_num_hidden_layers=real, share_layers=True)


def test_source_depths_stack_and_interleave():
    assert source_depths(2, 8, "stack") == [0, 1, 0, 1, 0, 1, 0, 1]
    assert source_depths(2, 8, "interleave") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert source_depths(3, 8, "interleave") == [0, 0, 0, 1, 1, 1, 2, 2]
    assert source_depths(4, 4, "stack") == source_depths(4, 4, "interleave") == [0, 1, 2, 3]


def test_delink_sources_across_a_growth():
    assert delink_sources(2, 2, 8, "cycle", new_num_hidden_layers=8) == [0, 1] * 4  # stack: every layer its own
    assert delink_sources(2, 2, 8, "cycle", new_num_hidden_layers=8, growth="interleave") == [0] * 4 + [1] * 4
    assert delink_sources(4, 2, 2, "cycle", new_num_hidden_layers=8) == [0, 1]  # the 2 blocks run at 8 depths
    assert delink_sources(4, 4, 4, "sequence", new_num_hidden_layers=8, growth="interleave") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="4 <= num_unique_layers <= num_hidden_layers"):
        delink_sources(4, 4, 2, "cycle", new_num_hidden_layers=8)  # fewer blocks than the model has
    with pytest.raises(ValueError, match="num_unique_layers"):
        delink_sources(4, 2, 2, "cycle", new_num_hidden_layers=8, growth="interleave")  # [0,0,1,1,0,0,1,1] != cycle
    with pytest.raises(ValueError, match="num_hidden_layers"):
        delink_sources(4, 2, 8, "cycle", new_num_hidden_layers=3)  # no shrinking
    with pytest.raises(ValueError, match="growth"):
        delink_sources(4, 2, 8, "cycle", new_num_hidden_layers=8, growth="random")


# Growth maps weights bitwise.


@pytest.mark.parametrize("growth", ["stack", "interleave"])
def test_growth_copies_every_layer_bitwise_from_its_source_depth(growth):
    model = tiny_model(num_hidden_layers=3, real_num_hidden_layers=8, attention_bias=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    modules = list(model.model.layers)
    mapping = model.delink_parameter_map(growth=growth)
    assert model.delink(growth=growth) is model
    config = model.config
    assert (config.num_hidden_layers, config.num_unique_layers, config.share_layers) == (8, 8, False)
    assert config.real_num_hidden_layers is None  # grown to its real depth
    sources = source_depths(3, 8, growth)
    after = dict(model.named_parameters())
    assert mapping.keys() == after.keys()
    for name, param in after.items():
        layer = _layer(name)
        expected = name if layer is None else f"model.layers.{sources[layer[0]]}.{layer[1]}"
        assert mapping[name] == expected
        assert torch.equal(param, before[expected]), name
    first = [sources.index(old) for old in range(3)]  # the first copy of each layer is the layer itself
    assert [model.model.layers[new] for new in first] == modules
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(8))
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(pointers) == len(set(pointers)), "grown layers must not share storage"


def test_a_shared_shallow_model_stacked_keeps_its_blocks_and_is_the_full_depth_pseudo_model(input_ids):
    model = tiny_model(num_hidden_layers=4, share_layers=True, num_unique_layers=2, real_num_hidden_layers=8)
    blocks = list(model.model.layers)
    model.delink(2, num_hidden_layers=8)
    assert list(model.model.layers) == blocks and model.config.block_of_depth == [0, 1] * 4
    full_depth = P2RForCausalLM(tiny_config(share_layers=True, num_unique_layers=2)).eval()
    full_depth.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, full_depth(input_ids).logits)


def test_delink_of_a_shallow_unshared_model_without_growth_says_to_grow_it():
    with pytest.raises(ValueError, match="grow it"):
        tiny_model(num_hidden_layers=2, real_num_hidden_layers=8).delink(num_hidden_layers=2)
    with pytest.raises(ValueError, match="already real"):
        tiny_model().delink()


def test_a_real_model_may_grow_past_its_depth():
    model = tiny_model(num_hidden_layers=2).delink(num_hidden_layers=4)
    assert (model.config.num_hidden_layers, model.config.real_depth, len(model.model.layers)) == (4, 4, 4)


def test_growth_short_of_the_real_depth_keeps_recording_it():
    model = tiny_model(num_hidden_layers=1, real_num_hidden_layers=8).delink(num_hidden_layers=2)
    assert (model.config.num_hidden_layers, model.config.real_num_hidden_layers) == (2, 8)


# Function-preserving growth.


@pytest.mark.parametrize("growth", ["stack", "interleave"])
@pytest.mark.parametrize("shared", [False, True])
def test_function_preserving_growth_keeps_the_loss_bitwise(growth, shared, input_ids):
    """The later copies' residual outputs start at zero, so they add exactly 0 to the residual stream."""
    layout = dict(share_layers=True, num_unique_layers=1) if shared else {}
    model = tiny_model(num_hidden_layers=2, real_num_hidden_layers=8, attention_bias=True, mlp_bias=True, **layout)
    loss, before = _loss(model, input_ids), {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = model.delink_plan(growth=growth, function_preserving=True)
    model.delink(growth=growth, function_preserving=True)
    assert torch.equal(_loss(model, input_ids), loss)
    kept = {new for new, old in enumerate(source_depths(2, 8, growth)) if source_depths(2, 8, growth).index(old) == new}
    assert plan.fresh == frozenset(range(8)) - kept
    for name, param in model.named_parameters():
        block, rest = _layer(name) or (None, None)
        zero = block is not None and block not in kept and RESIDUAL_OUTPUT.match(rest)
        source = name if block is None else f"model.layers.{plan.sources[block]}.{rest}"
        assert torch.equal(param, torch.zeros_like(param) if zero else before[source]), name
    # the grown model is not the shallow one: it trains all its layers
    model.train()(input_ids, labels=input_ids).loss.backward()
    assert all(layer.self_attn.o_proj.weight.grad.abs().sum() > 0 for layer in model.model.layers)


def test_function_preserving_growth_of_a_moe_model_keeps_the_loss_bitwise(input_ids):
    model = moe_model(num_hidden_layers=2, real_num_hidden_layers=8, decoder_sparse_step=2)
    loss = _loss(model, input_ids)
    model.delink(function_preserving=True)
    assert torch.equal(_loss(model, input_ids), loss)
    assert model.config.mlp_only_layers == [] and model.config.sparse_depths == [False, True] * 4
    assert not model.model.layers[3].mlp.experts.down_proj.any() and model.model.layers[1].mlp.experts.down_proj.any()


def test_a_shared_block_at_kept_and_zeroed_depths_is_refused_naming_it():
    model = tiny_model(num_hidden_layers=2, real_num_hidden_layers=8)
    with pytest.raises(ValueError, match="block 0 would run both"):
        model.delink(4, num_hidden_layers=8, function_preserving=True)  # cycle 4 blocks: block 0 at depths 0 and 4
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2


def test_growing_a_moe_model_off_its_sparse_grid_is_refused():
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        moe_model(num_hidden_layers=2, real_num_hidden_layers=8, decoder_sparse_step=2).delink(growth="interleave")


# Depth-µP.


def test_depth_mup_multiplies_each_branch_by_one_over_the_root_of_the_depth(input_ids):
    """A Depth-µP model computes what a plain model with its output projections times 1/sqrt(d) computes."""
    mup = tiny_model(num_hidden_layers=3, depth_mup=True, attention_bias=True, mlp_bias=True)
    assert mup.config.residual_multiplier == mup.config.block_lr_scale == 1 / math.sqrt(3)
    plain = P2RForCausalLM(tiny_config(num_hidden_layers=3, attention_bias=True, mlp_bias=True)).eval()
    plain.load_state_dict(mup.state_dict())
    with torch.no_grad():
        unscaled = plain(input_ids).logits
        for name, param in plain.named_parameters():
            if (layer := _layer(name)) and RESIDUAL_OUTPUT.match(layer[1]):
                param.mul_(1 / math.sqrt(3))
        logits = mup(input_ids).logits
        torch.testing.assert_close(logits, plain(input_ids).logits, rtol=1e-5, atol=1e-6)
        assert (logits - unscaled).abs().max() > 1e-3  # the multiplier matters


def test_depth_mup_initialises_the_branch_outputs_without_the_depth_factor():
    torch.manual_seed(0)
    mup, plain = tiny_model(num_hidden_layers=8, depth_mup=True), tiny_model(num_hidden_layers=8)
    assert mup.residual_projection_std == 0.02 and plain.residual_projection_std == 0.02 / 4
    std = torch.cat([layer.self_attn.o_proj.weight.flatten() for layer in mup.model.layers]).std()
    assert 0.018 < std < 0.022


@pytest.mark.parametrize("moe", [False, True])
def test_function_preserving_growth_under_depth_mup_rescales_the_kept_outputs(moe, input_ids):
    """Growing 3 -> 8 changes the multiplier from 1/sqrt(3) to 1/sqrt(8): the kept layers' outputs are multiplied by
    sqrt(8/3), so the loss is the shallow model's to fp32 rounding (not bitwise: the factor is not a power of 2)."""
    fields = dict(num_hidden_layers=3, real_num_hidden_layers=8, depth_mup=True)
    model = moe_model(**fields) if moe else tiny_model(**fields)
    loss, before = _loss(model, input_ids), {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = model.delink_plan(function_preserving=True)
    assert plan.output_scale == math.sqrt(8 / 3)
    model.delink(function_preserving=True)
    assert model.config.residual_multiplier == 1 / math.sqrt(8)
    torch.testing.assert_close(_loss(model, input_ids), loss, rtol=1e-6, atol=0)
    assert plan.fresh == frozenset(range(3, 8))  # stack: depths 0, 1, 2 keep layers 0, 1, 2
    weight = model.model.layers[1].self_attn.o_proj.weight
    assert torch.equal(weight, before["model.layers.1.self_attn.o_proj.weight"] * math.sqrt(8 / 3))


def test_growth_under_depth_mup_without_function_preservation_keeps_the_weights_and_changes_the_function(input_ids):
    model = tiny_model(num_hidden_layers=2, real_num_hidden_layers=4, depth_mup=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _loss(model, input_ids)
    model.delink()
    for name, param in model.named_parameters():
        block, rest = _layer(name) or (None, None)
        assert torch.equal(param, before[name if block is None else f"model.layers.{block % 2}.{rest}"])
    assert not torch.equal(_loss(model, input_ids), loss)


# Loading and saving a shallow stage.


def test_a_shallow_checkpoint_loads_as_it_was_saved(tmp_path, input_ids):
    model = tiny_model(num_hidden_layers=2, share_layers=True, num_unique_layers=1, real_num_hidden_layers=8)
    model.save_pretrained(tmp_path)
    loaded = P2RForCausalLM.from_pretrained(tmp_path).eval()
    assert _layout(loaded.config) == _layout(model.config) == (2, 1, True, 8)
    state, stored = loaded.state_dict(), model.state_dict()
    assert state.keys() == stored.keys() and all(torch.equal(state[k], stored[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("growth", ["stack", "interleave"])
def test_from_pretrained_grows_as_delink_does(tmp_path, input_ids, auto, growth):
    tiny_model(num_hidden_layers=2, real_num_hidden_layers=8).save_pretrained(tmp_path)
    loader = AutoModelForCausalLM if auto else P2RForCausalLM
    loaded = loader.from_pretrained(tmp_path, num_hidden_layers=8, growth=growth, function_preserving=True)
    grown = tiny_model(num_hidden_layers=2, real_num_hidden_layers=8).delink(growth=growth, function_preserving=True)
    assert _layout(loaded.config) == _layout(grown.config) == (8, 8, False, None)
    state, expected = loaded.state_dict(), grown.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)


def test_from_pretrained_grows_only_when_told_how(tmp_path):
    tiny_model(num_hidden_layers=2, real_num_hidden_layers=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers=8 differs .*`growth`"):
        P2RForCausalLM.from_pretrained(tmp_path, num_hidden_layers=8)
    with pytest.raises(ValueError, match="function_preserving: nothing grows"):
        P2RForCausalLM.from_pretrained(tmp_path, function_preserving=True)
    deeper = P2RForCausalLM.from_pretrained(tmp_path, num_hidden_layers=16, growth="stack")
    assert (deeper.config.num_hidden_layers, deeper.config.real_num_hidden_layers) == (16, None)  # past the real depth


# FLOPs: one formula, of the depth a model runs.

FLOP_MODELS = {
    "real": lambda: P2RForCausalLM(tiny_config()),
    "shallow stage": lambda: P2RForCausalLM(tiny_config(num_hidden_layers=3, real_num_hidden_layers=8)),
    "pseudo, tied, bias, head_dim": lambda: P2RForCausalLM(
        tiny_config(share_layers=True, num_unique_layers=2, tie_word_embeddings=True, attention_bias=True, head_dim=16)
    ),
    "moe, every 2nd sparse": lambda: P2RMoeForCausalLM(moe_config(decoder_sparse_step=2, num_hidden_layers=4)),
}


@pytest.mark.parametrize("build", FLOP_MODELS.values(), ids=FLOP_MODELS)
def test_the_flops_formula_is_what_torch_counts_for_forward_and_backward(build, input_ids):
    """`inventory(config).flops(seq_len)` per token equals torch's FlopCounterMode over forward + backward exactly
    (eager attention: torch 2.13's counter has no formula for the CPU SDPA kernel; the MoE's experts run eagerly,
    one matrix product per expert and its tokens)."""
    torch.manual_seed(0)
    model = build()
    model.set_attn_implementation("eager")
    if isinstance(model, P2RMoeForCausalLM):
        model.set_experts_implementation("eager")
    with FlopCounterMode(display=False) as counter:
        model(input_ids, labels=input_ids).loss.backward()
    assert counter.get_total_flops() == inventory(model.config).flops(input_ids.shape[1]) * input_ids.numel()


def test_a_shallow_stage_costs_its_depth_and_a_growth_plan_gives_the_next_stages_inventory():
    shallow = tiny_config(num_hidden_layers=2, real_num_hidden_layers=8)
    real = tiny_config()
    seq = 16
    per_depth = inventory(real).depth_flops(0, seq)
    assert inventory(real).flops(seq) - inventory(shallow).flops(seq) == 6 * per_depth
    plan = plan_delink(shallow, num_hidden_layers=4)
    stage = inventory({**shallow.to_dict(), **plan.fields})
    assert stage.flops(seq) == inventory(tiny_config(num_hidden_layers=4)).flops(seq)
    assert len(stage.block_of_depth) == 4 and len(stage.blocks) == 4


def test_a_plan_delinks_only_the_model_it_was_made_for():
    model = tiny_model(num_hidden_layers=2, real_num_hidden_layers=8)
    plan = model.delink_plan(num_hidden_layers=4)
    with pytest.raises(ValueError, match="given alone"):
        model.delink(plan, num_hidden_layers=8)
    model.delink(plan)
    assert model.config.num_hidden_layers == 4
    with pytest.raises(ValueError, match="a DelinkPlan for a model of 2 layers and 2 blocks"):
        model.delink(plan)
