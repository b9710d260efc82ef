"""hf_p2r.distributed's argument checks (the two-process behaviour is in tests/distributed/test_fsdp2.py)."""

import pytest

from hf_p2r.distributed import delink_fully_sharded, gather_shared_once

from .conftest import tiny_model


def test_gather_shared_once_needs_fsdp_units():
    with pytest.raises(ValueError, match=r"model.layers.0 is not an FSDP2 unit"):
        gather_shared_once(tiny_model(share_layers=True, num_unique_layers=2))


def test_gather_shared_once_leaves_a_real_model_alone():
    model = tiny_model()
    assert gather_shared_once(model) is model
    assert not any(block._forward_hooks for block in model.model.layers)


def test_delink_fully_sharded_refuses_real_models_and_invalid_targets():
    with pytest.raises(ValueError, match="already real"):
        delink_fully_sharded(tiny_model(), shard=lambda model: model)
    with pytest.raises(ValueError, match="cannot be reached"):
        delink_fully_sharded(tiny_model(share_layers=True, num_unique_layers=2), 3, shard=lambda model: model)
