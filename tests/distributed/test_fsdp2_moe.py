"""FSDP2 (gloo, two CPU processes) on a pseudo MoE model through delink, against one process: each stored MoE block
(attention, router, experts) is one FSDP unit, as a dense block is."""

import copy
import functools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from hf_p2r.distributed import delink_fully_sharded, fully_shard_p2r

from ..models.test_modeling_p2r_moe import moe_model
from . import spawn
from .test_fsdp2 import ATOL, batches, carried_exactly, delink_and_carry, delink_plain, train_step

STEPS_BEFORE, STEPS_AFTER = 2, 2


def moe_through_delink(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    data = batches(STEPS_BEFORE + STEPS_AFTER)
    # No aux loss: it is not a mean over tokens, so two half-batch losses would not average to the full batch's.
    reference = moe_model(share_layers=True, num_unique_layers=2).train()
    model = copy.deepcopy(reference)
    shard = functools.partial(fully_shard_p2r, mesh=mesh)
    shard(model)
    units = [type(module).__name__ for module in model.modules() if isinstance(module, FSDPModule)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    local = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
    carried = None
    for step, input_ids in enumerate(data):
        if step == STEPS_BEFORE:
            old_optimizer, old_parameters = optimizer, dict(model.named_parameters())
            model, optimizer, parameter_map = delink_and_carry(
                model, optimizer, lambda m: delink_fully_sharded(m, shard=shard)
            )
            carried = carried_exactly(old_optimizer, old_parameters, optimizer, model, parameter_map)
            reference, reference_optimizer, _ = delink_and_carry(reference, reference_optimizer, delink_plain)
        train_step(model, optimizer, input_ids[local])
        train_step(reference, reference_optimizer, input_ids)
    final = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "units": units,
        "real_units": sum(isinstance(block, FSDPModule) for block in model.model.layers),
        "carried": carried,
        "max_diff": max((final[name] - p).abs().max().item() for name, p in reference.named_parameters()),
    }


run = spawn.shared_run(moe_through_delink, 2)


def test_each_moe_block_is_one_unit(run):
    # FSDP2 swaps in a subclass named FSDP<name>.
    assert sorted(run["units"]) == ["FSDPP2RMoeDecoderLayer", "FSDPP2RMoeDecoderLayer", "FSDPP2RMoeForCausalLM"]
    assert run["real_units"] == 8


def test_two_processes_match_one_through_the_delink(run):
    assert run["carried"], "expert and router optimizer state carried (scale) like any other"
    assert run["max_diff"] < ATOL
