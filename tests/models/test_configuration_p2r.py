import json

import pytest

from hf_p2r import P2RConfig, P2RForCausalLM, block_of_depth, delink_sources
from hf_p2r.models.p2r.sharing_p2r import reachable_block_counts

from ..conftest import tiny_config


def test_real_by_default_and_pseudo_defaults_to_one_block():
    real = tiny_config()
    assert (real.share_layers, real.num_unique_layers, real.num_blocks) == (False, 8, 8)
    pseudo = tiny_config(share_layers=True)
    assert (pseudo.num_unique_layers, pseudo.num_blocks, pseudo.num_hidden_layers) == (1, 1, 8)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(share_layers=True, num_unique_layers=0), "num_unique_layers"),
        (dict(share_layers=True, num_unique_layers=8), "num_unique_layers"),  # k == L is the real model
        (dict(share_layers=True, num_unique_layers=9), "num_unique_layers"),
        (dict(share_layers=False, num_unique_layers=2), "num_unique_layers"),
        (dict(share_layers=True, sharing_pattern="random"), "sharing_pattern"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
    ],
)
def test_invalid_combinations_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_wrong_types_are_rejected_by_strict_validation_naming_the_field():
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    with pytest.raises(StrictDataclassFieldValidationError, match="num_unique_layers"):
        tiny_config(share_layers=True, num_unique_layers=2.0)


def test_block_of_depth_patterns():
    assert block_of_depth(8, 1, "cycle") == [0] * 8
    assert block_of_depth(8, 3, "cycle") == [0, 1, 2, 0, 1, 2, 0, 1]
    assert block_of_depth(8, 2, "sequence") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert block_of_depth(8, 3, "sequence") == [0, 0, 0, 1, 1, 1, 2, 2]
    assert tiny_config(share_layers=True, num_unique_layers=4).block_of_depth == [0, 1, 2, 3] * 2
    assert tiny_config().block_of_depth == list(range(8))


def test_delink_sources_valid_transitions():
    assert delink_sources(16, 1, 4, "cycle") == [0, 0, 0, 0]
    assert delink_sources(16, 4, 16, "cycle") == [0, 1, 2, 3] * 4
    assert delink_sources(16, 2, 4, "sequence") == [0, 0, 1, 1]
    assert delink_sources(6, 4, 6, "sequence") == [0, 0, 1, 2, 2, 3]  # full delink is always valid
    assert delink_sources(8, 3, 8, "cycle") == [0, 1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize(
    ("depth", "old", "new", "pattern"),
    [
        (16, 2, 3, "cycle"),  # 2 does not divide 3
        (16, 4, 6, "cycle"),
        (16, 4, 2, "cycle"),  # fewer blocks: re-sharing
        (16, 4, 4, "cycle"),
        (16, 4, 17, "cycle"),
        (8, 2, 3, "sequence"),  # groups [0..2],[3..5],[6,7] straddle the old boundary at depth 4
    ],
)
def test_delink_sources_rejects_function_changing_transitions(depth, old, new, pattern):
    with pytest.raises(ValueError, match="num_unique_layers"):
        delink_sources(depth, old, new, pattern)


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config(share_layers=True, num_unique_layers=2, sharing_pattern="sequence")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "p2r"
    assert (saved["share_layers"], saved["num_unique_layers"], saved["sharing_pattern"]) == (True, 2, "sequence")
    loaded = P2RConfig.from_pretrained(tmp_path)
    assert loaded.block_of_depth == config.block_of_depth


@pytest.mark.parametrize(
    ("stored", "overrides", "field"),
    [
        (dict(share_layers=True, num_unique_layers=2), dict(num_unique_layers=9), "num_unique_layers"),
        (dict(share_layers=True, num_unique_layers=2), dict(num_unique_layers=0), "num_unique_layers"),
        (dict(), dict(num_unique_layers=4), "num_unique_layers"),  # a real config cannot hold 4 blocks
        (dict(share_layers=True), dict(sharing_pattern="random"), "sharing_pattern"),
        (dict(), dict(num_hidden_layers=0), "num_hidden_layers"),
    ],
)
def test_from_pretrained_overrides_are_validated(tmp_path, stored, overrides, field):
    tiny_config(**stored).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):
        P2RConfig.from_pretrained(tmp_path, **overrides)


def test_inconsistent_config_json_is_rejected_with_or_without_overrides(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_unique_layers"] = 3  # share_layers stays false
    (tmp_path / "config.json").write_text(json.dumps(config))
    for overrides in ({}, dict(num_hidden_layers=12), dict(sharing_pattern="sequence")):
        with pytest.raises(ValueError, match="num_unique_layers"):
            P2RConfig.from_pretrained(tmp_path, **overrides)


def test_from_pretrained_overrides_rederive_num_unique_layers(tmp_path):
    tiny_config(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path / "pseudo")
    real = P2RConfig.from_pretrained(tmp_path / "pseudo", share_layers=False)
    assert (real.share_layers, real.num_unique_layers) == (False, 8)
    wider = P2RConfig.from_pretrained(tmp_path / "pseudo", num_unique_layers=4)
    assert (wider.share_layers, wider.num_unique_layers) == (True, 4)
    tiny_config().save_pretrained(tmp_path / "real")
    deeper = P2RConfig.from_pretrained(tmp_path / "real", num_hidden_layers=12)
    assert (deeper.num_unique_layers, deeper.num_blocks) == (12, 12)


@pytest.mark.parametrize(
    ("assignments", "field"),
    [
        (dict(num_unique_layers=0), "num_unique_layers"),
        (dict(share_layers=False), "num_unique_layers"),  # k = 2 left behind on a real config
        (dict(num_unique_layers=8), "num_unique_layers"),
        (dict(sharing_pattern="random"), "sharing_pattern"),
    ],
)
def test_fields_assigned_after_construction_are_checked_by_the_model(assignments, field):
    config = tiny_config(share_layers=True, num_unique_layers=2)
    for name, value in assignments.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=field):
        P2RForCausalLM(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_hidden_layers=10**9), "num_hidden_layers is 1000000000, more than any model has"),
        (dict(hidden_size=-64), "hidden_size must be a positive integer, got -64"),  # -64 % 4 == 0: Llama took it
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(head_dim=7), "head_dim \\(7\\) must be even"),
        (dict(num_key_value_heads=3), "num_attention_heads \\(4\\) must be a multiple of num_key_value_heads \\(3\\)"),
    ],
)
def test_sizes_are_bounded_and_positive_on_construction(overrides, message):
    """A plain `ValueError` naming the field, at once: no list of 10**9 depths, no model of negative width (the
    planner crashed on hidden_size -64, which Llama's own check lets through)."""
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_moe_sizes_are_bounded_on_construction():
    from hf_p2r.models.p2r.configuration_p2r_moe import P2RMoeConfig

    from .test_modeling_p2r_moe import moe_config

    with pytest.raises(ValueError, match="num_experts is 1000000000, more than any model has"):
        moe_config(num_experts=10**9)
    assert moe_config(router_aux_loss_coef=0).router_aux_loss_coef == 0, "a config.json may write 0 for 0.0"
    assert isinstance(P2RMoeConfig.from_dict({"router_aux_loss_coef": 0}), P2RMoeConfig)


def test_reachable_block_counts_are_what_delink_sources_accepts():
    for depth in range(2, 25):
        for old in range(1, depth):
            for pattern in ("cycle", "sequence"):
                accepted = []
                for new in range(old + 1, depth + 1):
                    try:
                        delink_sources(depth, old, new, pattern)
                        accepted.append(new)
                    except ValueError:
                        pass
                assert reachable_block_counts(depth, old, pattern) == accepted, (depth, old, pattern)
