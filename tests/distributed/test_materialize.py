"""Meta-device construction (`hf_p2r.distributed.materialize`): a model built on the meta device and materialised only
where a process holds it has the weights of the whole model materialised in one process, bitwise, for pseudo, real,
tied and MoE models: part of a model in one process, a 2-stage pipeline's stages, FSDP2 shards (`fully_shard_p2r`
and Accelerate's `fsdp2_prepare_model`, gathered here to compare), sharded pipeline stages (2 x 2 processes). A
pipelined process never allocates the other stage's tensors."""

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hf_p2r import P2RForCausalLM
from hf_p2r.distributed import fully_shard_p2r
from hf_p2r.distributed.materialize import materialize, materialized_bytes, module_seed
from hf_p2r.distributed.pipeline import build_pipeline, pipeline_mesh
from hf_p2r.models.p2r import P2RMoeForCausalLM

from ..conftest import tiny_config
from ..models.test_modeling_p2r_moe import moe_config
from . import spawn
from .test_accelerate_configs import launch_env

SEED = 1234
KINDS = {
    "pseudo": lambda: tiny_config(share_layers=True, num_unique_layers=2),
    "cycle": lambda: tiny_config(share_layers=True, num_unique_layers=2, sharing_pattern="cycle"),
    "real": lambda: tiny_config(),
    "tied": lambda: tiny_config(tie_word_embeddings=True),
    "moe": lambda: moe_config(),
    "moe_pseudo": lambda: moe_config(share_layers=True, num_unique_layers=2),
}


def meta_model(kind: str):
    config = KINDS[kind]()
    with torch.device("meta"):
        return (P2RMoeForCausalLM if kind.startswith("moe") else P2RForCausalLM)(config)


def whole(kind: str) -> dict[str, torch.Tensor]:
    """The one-process model's weights and buffers (the reference every layout must equal)."""
    model = meta_model(kind)
    materialize(model, SEED)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def meta_names(module: nn.Module) -> list[str]:
    return [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]


# --- one process ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_whole_model_is_initialised_by_the_models_own_init(kind):
    """Every tensor set, of the statistics transformers' `post_init` gives (norms 1, residual projections scaled by
    depth, the padding row 0), the rotary tables equal to a model built the ordinary way; a tied head stays tied."""
    model = meta_model(kind)
    allocated = materialize(model, SEED)
    assert meta_names(model) == []
    assert allocated == materialized_bytes(model) > 0
    ordinary = type(model)(model.config)
    for name, buffer in ordinary.named_buffers():
        assert torch.equal(buffer, model.get_buffer(name)), name
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        assert param.requires_grad and torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
            assert param.std().item() == pytest.approx(std / (2 * model.config.num_hidden_layers) ** 0.5, rel=0.2)
        elif name.endswith(("q_proj.weight", "lm_head.weight", "gate_up_proj")):
            assert param.std().item() == pytest.approx(std, rel=0.2), name
    assert torch.equal(model.model.embed_tokens.weight[0], torch.zeros(model.config.hidden_size))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (kind == "tied")
    output = model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]]))
    assert torch.isfinite(output.loss)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_values_depend_on_the_seed_and_the_name_only(kind):
    """The global RNG's state, the order and the part materialised change nothing; another seed changes every
    randomly initialised tensor; the global RNG is left as it was."""
    reference = whole(kind)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    model = meta_model(kind)
    blocks = list(model.model.layers)
    materialize(model, SEED, keep=blocks[::-1])  # the blocks only, last first
    assert torch.equal(torch.get_rng_state(), state)
    assert meta_names(model.model.layers) == []
    assert "model.embed_tokens.weight" in meta_names(model)
    for name, tensor in model.model.layers.named_parameters():
        assert torch.equal(tensor, reference[f"model.layers.{name}"]), name
    other = meta_model(kind)
    materialize(other, SEED + 1)
    for name, tensor in other.named_parameters():
        if tensor.std() > 0:
            assert not torch.equal(tensor, reference[name]), name


def test_a_head_tied_to_embeddings_it_does_not_hold_takes_their_values():
    """A last stage holds the head, not the embeddings: the head gets the embeddings' initialisation (the owner's
    seed), allocated once; the embeddings module's own slot is left on the meta device's."""
    reference = whole("tied")
    model = meta_model("tied")
    allocated = materialize(model, SEED, keep=[model.lm_head, model.model.norm])
    assert torch.equal(model.lm_head.weight, reference["model.embed_tokens.weight"])
    assert model.model.embed_tokens.weight.is_meta
    assert allocated == model.lm_head.weight.nbytes + model.model.norm.weight.nbytes


def test_a_tensor_the_init_leaves_unset_is_refused():
    model = meta_model("real")
    model.model.layers[0].extra = nn.Parameter(torch.empty(3, device="meta"))  # no `_init_weights` rule for it
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra is not initialised by P2RModel"):
        materialize(model, SEED)


def test_module_seeds_differ_by_name_and_seed():
    seeds = {module_seed(s, n) for s in (0, 1) for n in ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj")}
    assert len(seeds) == 4 and all(0 <= seed < 2**63 for seed in seeds)


# --- several processes ---------------------------------------------------------------------------------------------
def differences(reference: dict, named: dict) -> list[str]:
    return sorted(name for name, tensor in named.items() if not torch.equal(tensor, reference[name]))


def pipelines(rank: int, world_size: int) -> dict:
    """2-stage pipelines built from meta models: each process's stages against the one-process model."""
    out = {}
    for kind in ("pseudo", "cycle", "real", "tied"):
        reference = whole(kind)
        model = meta_model(kind)
        pipeline = build_pipeline(model, schedule="1f1b", num_microbatches=2, seq_len=16, split=[4, 4], seed=SEED)
        mine = dict(pipeline.named_parameters())
        held = {id(tensor) for module in pipeline.modules for tensor in [*module.parameters(), *module.buffers()]}
        out[kind] = {
            "differ": differences(reference, mine),
            "names": sorted(mine),
            # Everything of the model outside this process's stages is still on the meta device, never allocated.
            "others_meta": all(
                tensor.is_meta
                for tensor in [*model.parameters(), *model.buffers()]
                if id(tensor) not in held and not (kind == "tied" and tensor is model.model.embed_tokens.weight)
            ),
            "bytes": materialized_bytes(model),
            "stage_bytes": sum(t.nbytes for t in {id(t): t for m in pipeline.modules for t in m.parameters()}.values())
            + sum(b.nbytes for b in model.model.rotary_emb.buffers()),
            "whole_bytes": sum(t.nbytes for t in reference.values()),
        }
        pipeline.step(torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(0)))  # it runs
    return out


# configs/accelerate/fsdp2.yaml wraps P2RDecoderLayer (by class name): the dense models.
WRAPS = {"fully_shard_p2r": ("pseudo", "real", "tied", "moe", "moe_pseudo"), "accelerate": ("pseudo", "real", "tied")}


def shards(rank: int, world_size: int) -> dict:
    """FSDP2 on meta models (hf-p2r's `fully_shard_p2r` and Accelerate's `fsdp2_prepare_model`), then the shards."""
    mesh = init_device_mesh("cpu", (world_size,))
    with mock.patch.dict(os.environ, launch_env("fsdp2")):
        plugin = FullyShardedDataParallelPlugin()
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no", is_main_process=rank == 0
    )
    out = {}
    for wrap, kinds in WRAPS.items():
        for kind in kinds:
            reference = whole(kind)
            model = meta_model(kind)
            if wrap == "accelerate":
                model = fsdp2_prepare_model(accelerator, model)
            else:
                fully_shard_p2r(model, mesh=mesh)
            if kind == "real":  # shards still on the meta device: refused, not filled silently
                try:
                    materialize(model, SEED)
                except ValueError as error:
                    out[f"{wrap}/unallocated"] = str(error)
            model.to_empty(device="cpu")
            allocated = materialize(model, SEED)
            local = materialized_bytes(model)
            gathered = {name: param.full_tensor() for name, param in model.named_parameters()}
            gathered.update(model.named_buffers())
            out[f"{wrap}/{kind}"] = {
                "differ": differences(reference, gathered),
                "count": len(gathered),
                "allocated": allocated,
                "local": local,
                "whole_bytes": sum(t.nbytes for t in reference.values()),
            }
    return out


def sharded_pipelines(rank: int, world_size: int) -> dict:
    """2 stages x 2 sharded data-parallel replicas, from a meta model: each process's shards of its stage."""
    mesh = pipeline_mesh(2, 2)
    out = {}
    for kind in ("pseudo", "real", "tied"):
        reference = whole(kind)
        model = meta_model(kind)
        pipeline = build_pipeline(
            model, schedule="1f1b", num_microbatches=2, seq_len=16, split=[4, 4], mesh=mesh, shard=True, seed=SEED
        )
        out[kind] = {
            "differ": differences(reference, pipeline.state_dict(full=True)),
            "names": len(pipeline.parameters()),
        }
    return out


pipelined = spawn.shared_run(pipelines, 2)
sharded = spawn.shared_run(shards, 2)


@pytest.mark.parametrize("kind", ["pseudo", "cycle", "real", "tied"])
def test_pipeline_stages_equal_the_one_process_model(pipelined, kind):
    run = pipelined[kind]
    assert run["names"] and run["differ"] == []


@pytest.mark.parametrize("kind", ["pseudo", "cycle", "real", "tied"])
def test_a_pipelined_process_never_allocates_the_other_stage(pipelined, kind):
    run = pipelined[kind]
    assert run["others_meta"]
    assert run["bytes"] == run["stage_bytes"] < run["whole_bytes"]


@pytest.mark.parametrize("case", [f"{wrap}/{kind}" for wrap, kinds in WRAPS.items() for kind in kinds])
def test_fsdp2_shards_gathered_equal_the_one_process_model(sharded, case):
    run = sharded[case]
    assert run["count"] > 0 and run["differ"] == []
    # Each process allocated its shards (and the small unsharded buffers), about half the model, never all of it.
    assert run["allocated"] == run["local"] < 0.6 * run["whole_bytes"]


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_shards_on_the_meta_device_are_refused(sharded, wrap):
    assert "is sharded on the meta device: allocate the shards first" in sharded[f"{wrap}/unallocated"]


def test_sharded_pipeline_stages_equal_the_one_process_model(tmp_path):
    runs = spawn.run(sharded_pipelines, 4, tmp_path)
    for kind, run in runs.items():
        assert run["names"] > 0 and run["differ"] == [], kind
