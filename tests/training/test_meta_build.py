"""The trainer's engines take the model on the meta device (`build_model(..., meta=True)`) and materialise what their
process holds: one process (AccelerateEngine) and each process of a 2-stage pipeline (PipelineEngine) hold exactly the
weights `build_model` materialises in one process for the same seed, bitwise; a pipelined process leaves the other
stage's tensors on the meta device."""

import tempfile

import pytest
import torch

from hf_p2r.distributed.materialize import materialized_bytes
from hf_p2r.training import parse_config
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.engines import engine_for
from hf_p2r.training.train import build_model

from ..distributed import spawn
from .helpers import tiny_argv

CASES = {
    "pseudo": {"num_unique_layers": 1},
    "real": {"pseudo_steps": 0},  # a real model from scratch
    "moe": {"num_unique_layers": 2, "num_experts": 4, "num_experts_per_tok": 2},
}


def reference_and_built(output_dir: str, **fields) -> tuple[dict, torch.nn.Module, object]:
    """(the one-process build_model's weights, the meta model handed to the engine, the built engine)."""
    config = parse_config(tiny_argv(output_dir, seed=7, **fields))
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    blocks = config.initial_blocks()
    reference = build_model(config, tokenizer, blocks)
    engine = engine_for(config)
    model = build_model(config, tokenizer, blocks, meta=True)
    assert all(tensor.is_meta for tensor in model.parameters())
    engine.build(model, blocks)
    return dict(reference.named_parameters()), model, engine


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_engine_materialises_build_models_weights(tmp_path, case):
    reference, _, engine = reference_and_built(str(tmp_path), **CASES[case])
    try:
        built = dict(engine.accelerator.unwrap_model(engine.model).named_parameters())
        assert sorted(built) == sorted(reference)
        assert [name for name in reference if not torch.equal(built[name], reference[name])] == []
    finally:
        engine.close()


def pipelined(rank: int, world_size: int) -> dict:
    out = {}
    for case in ("pseudo", "real"):
        reference, model, engine = reference_and_built(tempfile.mkdtemp(), pipeline_parallel_size=2, **CASES[case])
        mine = dict(engine.pipeline.named_parameters())
        out[case] = {
            "differ": [name for name, tensor in mine.items() if not torch.equal(tensor, reference[name])],
            "held": len(mine),
            "whole": len(reference),
            "allocated": materialized_bytes(model),
            "stage": sum(t.nbytes for t in mine.values()) + sum(b.nbytes for b in model.model.rotary_emb.buffers()),
        }
        engine.close()
    return out


def test_each_pipelined_process_materialises_its_stage_of_build_models_weights(tmp_path):
    runs = spawn.run(pipelined, 2, tmp_path)
    for case, run in runs.items():
        assert run["differ"] == [] and 0 < run["held"] < run["whole"], case
        assert run["allocated"] == run["stage"], case  # nothing of the other stage was allocated
