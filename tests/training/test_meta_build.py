"""The trainer's engines take the model on the meta device (`build_model(..., meta=True)`) and materialise what their
process holds: one process (AccelerateEngine) and each process of a 2-stage pipeline (PipelineEngine) hold exactly the
weights `build_model` materialises in one process for the same seed, bitwise; a pipelined process leaves the other
stage's tensors on the meta device; under FSDP2 (the engine's `shard_on_meta`, 2 gloo processes) each process
allocates only its shards, which gather to the same weights."""

import os
import tempfile
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

from hf_p2r.distributed.materialize import materialize, materialized_bytes
from hf_p2r.training import parse_config
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.engines import AccelerateEngine, engine_for
from hf_p2r.training.train import build_model

from ..distributed import spawn
from ..distributed.test_accelerate_configs import launch_env
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


def accelerate_fsdp2(rank: int, world_size: int) -> dict:
    """AccelerateEngine.shard_on_meta with configs/accelerate/fsdp2.yaml's plugin (its cpu_ram_efficient_loading on,
    which has nothing to load from a meta model), then `materialize`: what `build` does under FSDP2 before
    `accelerator.prepare` (Accelerate turns FSDP off on a CPU run, so the Accelerator here is a stand-in)."""
    with mock.patch.dict(os.environ, launch_env("fsdp2")):
        plugin = FullyShardedDataParallelPlugin()
    plugin.cpu_ram_efficient_loading = True
    engine = AccelerateEngine.__new__(AccelerateEngine)
    engine.accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no", is_main_process=rank == 0, device="cpu"
    )
    out = {}
    for case in ("pseudo", "real"):
        config = parse_config(tiny_argv(tempfile.mkdtemp(), seed=7, **CASES[case]))
        tokenizer = load_tokenizer(config.data.tokenizer_name)
        reference = dict(build_model(config, tokenizer, config.initial_blocks()).named_parameters())
        model = engine.shard_on_meta(build_model(config, tokenizer, config.initial_blocks(), meta=True))
        materialize(model, config.train.seed)
        gathered = {name: param.full_tensor() for name, param in model.named_parameters()}
        out[case] = {
            "differ": [name for name in reference if not torch.equal(gathered[name], reference[name])],
            "names": sorted(gathered) == sorted(reference),
            "sharded": all(isinstance(param, DTensor) for param in model.parameters()),
            "allocated": materialized_bytes(model),
            "whole": sum(tensor.nbytes for tensor in reference.values()),
            "plugin_restored": plugin.cpu_ram_efficient_loading,
        }
    return out


def test_fsdp2_build_shards_on_meta_to_build_models_weights(tmp_path):
    runs = spawn.run(accelerate_fsdp2, 2, tmp_path)
    for case, run in runs.items():
        assert run["names"] and run["sharded"] and run["differ"] == [], case
        assert run["allocated"] < 0.6 * run["whole"], case  # its shards (and the rotary tables), not the model
        assert run["plugin_restored"] is True, case
