"""Granular offload materialises a meta-device model straight into its homes (`apply_offload` passes `materialize`
to `GranularOffload`): the resident modules on the compute device, then each offloaded block on the CPU and into its
(pinned, on CUDA) slab before the next is materialised, so the host never holds the whole model. The weights are
those `build_model` materialises in one process, bitwise. (Without CUDA the compute device is the CPU: the same code
path runs.)"""

import pytest
import torch

from hf_p2r.training import offload as offload_module
from hf_p2r.training import parse_config
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.engines import accelerate as accelerate_engine
from hf_p2r.training.engines import engine_for
from hf_p2r.training.offload import GranularOffload, decoder_layers
from hf_p2r.training.train import build_model

from .helpers import tiny_argv

CASES = {
    "pseudo": {"num_unique_layers": 2, "offload": "[0]"},
    "real": {"pseudo_steps": 0, "offload": "0.5"},
    "moe": {"num_unique_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "offload": "[1]"},
}


def built(tmp_path, monkeypatch, **fields):
    """(build_model's one-process model, the engine built from the meta-device model, the materialize calls)."""
    config = parse_config(tiny_argv(tmp_path / "run", seed=7, **fields))
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    blocks = config.initial_blocks()
    reference = build_model(config, tokenizer, blocks)
    engine = engine_for(config)
    model = build_model(config, tokenizer, blocks, meta=True)
    calls, materialize = [], offload_module.materialize

    def recorded(model, seed, *, keep, device):
        # Whether each part materialised before has left the tensors `materialize` gave it (copied into its slab).
        moved = [any(p.data_ptr() != ptr for p, ptr in call["tensors"]) for call in calls]
        materialize(model, seed, keep=keep, device=device)
        tensors = [(p, p.data_ptr()) for root in keep for p in root.parameters()]
        calls.append({"keep": list(keep), "device": torch.device(device), "moved before": moved, "tensors": tensors})

    def whole(*args, **kwargs):
        raise AssertionError("the engine materialised the whole model")

    monkeypatch.setattr(offload_module, "materialize", recorded)
    monkeypatch.setattr(accelerate_engine, "materialize", whole)
    engine.build(model, blocks)
    return reference, engine, calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_offloaded_model_materialises_build_models_weights(tmp_path, monkeypatch, case):
    """Every parameter and buffer equal to build_model's (bitwise); every offloaded parameter lives in its block's
    slab (its CPU master) and nothing is left on the meta device."""
    reference, engine, _ = built(tmp_path, monkeypatch, **CASES[case])
    try:
        engine.offload.synchronize()
        model = engine.accelerator.unwrap_model(engine.model)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        assert sorted(params) == sorted(dict(reference.named_parameters()))
        assert [n for n, p in reference.named_parameters() if not torch.equal(params[n], p)] == []
        assert [n for n, b in reference.named_buffers() if not torch.equal(buffers[n], b)] == []
        assert not any(t.is_meta for t in [*params.values(), *buffers.values()])
        for block in engine.offload._blocks.values():
            assert [p.data_ptr() for p in block.params] == [m.data_ptr() for m in block.masters]
    finally:
        engine.close()


def test_one_block_at_a_time(tmp_path, monkeypatch):
    """The resident modules are materialised once, on the compute device, without any offloaded block; then each
    offloaded block alone, on the CPU, after the previous one was placed in its slab. The engine never materialises
    the whole model."""
    _, engine, calls = built(tmp_path, monkeypatch, pseudo_steps=0, offload="0.5")  # blocks 1 and 3 of 4
    try:
        layers = decoder_layers(engine.accelerator.unwrap_model(engine.model))
        resident, *offloaded = calls
        assert resident["device"] == engine.accelerator.device
        held = {id(sub) for root in resident["keep"] for sub in root.modules()}
        assert {index for index, block in enumerate(layers) if id(block) in held} == {0, 2}
        assert [call["keep"] for call in offloaded] == [[layers[1]], [layers[3]]]
        assert [call["device"] for call in offloaded] == [torch.device("cpu")] * 2
        # When block 1 is materialised the resident modules are where they were materialised (on the device); when
        # block 3 is, block 1 has been copied into its slab already.
        assert offloaded[0]["moved before"] == [False]
        assert offloaded[1]["moved before"] == [False, True]
    finally:
        engine.close()


def test_a_meta_model_without_materialize_is_refused(tmp_path):
    config = parse_config(tiny_argv(tmp_path / "run"))
    model = build_model(config, load_tokenizer(config.data.tokenizer_name), 2, meta=True)
    with pytest.raises(ValueError, match=r"^offload: model\.embed_tokens\.weight is on the meta device: materialize"):
        GranularOffload(model, [1], device="cpu")
