"""transformers' own tensor and pipeline parallelism (`DistributedConfig`) on P2R models, two CPU processes (gloo).

The plans come from the config (`base_model_tp_plan` inherited from Llama, the head's `_tp_plan`): a pseudo model's
shared blocks are sharded like any layer and still run at every depth. Accelerate's `ParallelismConfig(tp_size=...)`
refuses CPU processes (MULTI_CPU) and is left to the GPU checks.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

from hf_p2r import P2RForCausalLM
from hf_p2r.planning import parameter_tensors

from ..conftest import tiny_model
from . import spawn

ATOL = 1e-6  # fp32; TP sums the row-parallel products in another order


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (sharded or replicated); a plain tensor (norm weights stay plain) as is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def compare(model, reference, input_ids, backward: bool) -> dict:
    output = model(input_ids=input_ids, labels=input_ids)
    expected = reference(input_ids=input_ids, labels=input_ids)
    result = {"logits": (output.logits - expected.logits).abs().max().item()}
    if backward:
        output.loss.backward()
        expected.loss.backward()
        grads = dict(reference.named_parameters())
        result["grads"] = max(
            (full(p.grad) - grads[name].grad).abs().max().item() for name, p in model.named_parameters()
        )
    return result


def parallel_runs(rank: int, world_size: int) -> dict:
    input_ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    output = {}
    pseudo = {"share_layers": True, "num_unique_layers": 2}
    cases = {
        "tp pseudo": (pseudo, {"tp_size": 2}),
        "tp real": ({}, {"tp_size": 2}),
        "pp real": ({}, {"pp_size": 2}),
        "pp pseudo sequence": (pseudo | {"sharing_pattern": "sequence"}, {"pp_size": 2}),
    }
    for name, (overrides, parallel) in cases.items():
        # save_pretrained writes on rank 0 only: every rank loads rank 0's folder
        folders = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(folders, src=0)
        folder = folders[0]
        if rank == 0:
            tiny_model(**overrides).save_pretrained(folder)
        dist.barrier()
        reference = P2RForCausalLM.from_pretrained(folder).train()
        model = P2RForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**parallel)).train()
        output[name] = compare(model, reference, input_ids, backward="tp_size" in parallel)
        if name == "tp pseudo" and rank == 0:
            # rank 0 holds the largest chunk: the planner's TP shapes, tensor by tensor
            planned = {t.name: list(t.tp_shape(2)) for t in parameter_tensors(model.config)}
            output["shapes"] = {n: [list(local(p).shape), planned[n]] for n, p in model.named_parameters()}
            output["stored_blocks"] = len(model.model.layers)
    return output


runs = spawn.shared_run(parallel_runs, 2)


@pytest.mark.parametrize("name", ["tp pseudo", "tp real"])
def test_tensor_parallel_matches_one_process(runs, name):
    assert runs[name]["logits"] < ATOL
    assert runs[name]["grads"] < ATOL


def test_tensor_parallel_shards_a_pseudo_model_as_planned(runs):
    assert runs["stored_blocks"] == 2  # still k blocks, each run at 4 depths
    for name, (local, planned) in runs["shapes"].items():
        assert local == planned, name
    # control: the shards really are shards (q_proj 32 -> 16 rows, o_proj 32 -> 16 columns, vocab 101 -> 51 rows)
    assert runs["shapes"]["model.layers.1.self_attn.q_proj.weight"][0] == [16, 32]
    assert runs["shapes"]["model.layers.1.self_attn.o_proj.weight"][0] == [32, 16]
    assert runs["shapes"]["model.embed_tokens.weight"][0] == [51, 32]


@pytest.mark.parametrize("name", ["pp real", "pp pseudo sequence"])
def test_pipeline_forward_matches_one_process(runs, name):
    # transformers' pipeline split is by stored block; with "sequence" sharing each block's depths are contiguous,
    # so the stages run the depths in order. (A "cycle" pseudo model cannot be split by stored block.)
    assert runs[name]["logits"] < ATOL
