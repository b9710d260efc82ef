"""FSDP2 (torch's `fully_shard`, gloo, two CPU processes) on a pseudo model, through delink, against one process.

Accelerate enables FSDP only on accelerators (on CPU its plugin is ignored), so these tests call `hf_p2r.distributed`
and Accelerate's own wrapping function (`fsdp2_prepare_model`) directly; `accelerate launch` with
`configs/accelerate/fsdp2.yaml` is left to the GPU checks.
"""

import copy
import functools
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hf_p2r.distributed import delink_fully_sharded, fully_shard_p2r, gather_shared_once
from hf_p2r.planning import PRECISIONS, Layout, model_state_bytes, parameter_tensors
from hf_p2r.training.carry import ParameterSnapshot, carry_optimizer_state

from ..conftest import tiny_model
from . import spawn
from .test_accelerate_configs import launch_env

# The compatibility pass (Makefile COMPAT_TESTS) runs this file on the declared floors and the newest releases too:
# FSDP2's sharding, Accelerate's FSDP2 plugin and the delink of sharded parameters.
pytestmark = pytest.mark.versions

STEPS_BEFORE, STEPS_AFTER, LR = 3, 3, 1e-2
# fp32 on CPU; the two-process gradient is the mean of two half-batch means, summed in another order than the
# one-process full-batch mean, and AdamW amplifies that rounding on tiny gradients.
ATOL = 1e-5


# The torch.distributed functions FSDP2 calls for its all-gathers and reduce-scatters: `*_single` since torch 2.12,
# `*_tensor` before.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class CollectiveCounter:
    """Counts FSDP2's all-gathers and reduce-scatters. Patches them for the rest of the (spawned, short-lived)
    process."""

    def __init__(self):
        self.all_gather = self.reduce_scatter = 0
        self._all_gather, self._reduce_scatter = getattr(dist, ALL_GATHER), getattr(dist, REDUCE_SCATTER)
        setattr(dist, ALL_GATHER, self._count_all_gather)
        setattr(dist, REDUCE_SCATTER, self._count_reduce_scatter)

    def _count_all_gather(self, *args, **kwargs):
        self.all_gather += 1
        return self._all_gather(*args, **kwargs)

    def _count_reduce_scatter(self, *args, **kwargs):
        self.reduce_scatter += 1
        return self._reduce_scatter(*args, **kwargs)

    def snapshot(self) -> tuple[int, int]:
        return self.all_gather, self.reduce_scatter


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 101, (4, 12), generator=generator) for _ in range(steps)]


def train_step(model, optimizer, input_ids) -> None:
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def delink_and_carry(model, optimizer, delink):
    """The trainer's delink step (`delink_in_training`): `delink(model)` -> (new model, {new name: old name}), then a
    new AdamW whose state `carry_optimizer_state` fills with carry "scale" (DTensor shards under FSDP2)."""
    before = ParameterSnapshot.of(model)
    new_model, parameter_map = delink(model)
    new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR)
    after = ParameterSnapshot.of(new_model)
    carry_optimizer_state(optimizer, new_optimizer, before, after, parameter_map, "scale")
    return new_model, new_optimizer, parameter_map


def delink_plain(model):
    parameter_map = model.delink_parameter_map()
    return model.delink(), parameter_map


def carried_exactly(old_optimizer, old_parameters: dict, new_optimizer, new_model, parameter_map: dict) -> bool:
    """Whether each new parameter's state is its source's, with the moments of a block that ran at 4 depths and now
    runs at 1 scaled by 1/4 and 1/16 (exact in binary), and the rest (embeddings, norm, head) unchanged."""
    for name, parameter in new_model.named_parameters():
        old = old_optimizer.state[old_parameters[parameter_map[name]]]
        new = new_optimizer.state[parameter]
        ratio = 0.25 if ".layers." in name else 1.0
        for key, factor in (("exp_avg", ratio), ("exp_avg_sq", ratio**2)):
            sharded_like_parameter = isinstance(new[key], DTensor) == isinstance(parameter, DTensor)
            if not sharded_like_parameter or not torch.equal(full(new[key]), full(old[key]) * factor):
                return False
        if not torch.equal(new["step"], old["step"]):
            return False
    return True


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pseudo_through_delink(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    counter = CollectiveCounter()
    data = batches(STEPS_BEFORE + STEPS_AFTER)
    reference = tiny_model(share_layers=True, num_unique_layers=2).train()
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    model = copy.deepcopy(reference)
    shard = functools.partial(fully_shard_p2r, mesh=mesh)
    shard(model)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    local = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)

    collectives = {}
    for step, input_ids in enumerate(data):
        if step == STEPS_BEFORE:
            before = counter.snapshot()
            old_optimizer, old_parameters = optimizer, dict(model.named_parameters())
            model, optimizer, parameter_map = delink_and_carry(
                model, optimizer, lambda m: delink_fully_sharded(m, shard=shard)
            )
            collectives["delink"] = [a - b for a, b in zip(counter.snapshot(), before)]
            carried = carried_exactly(old_optimizer, old_parameters, optimizer, model, parameter_map)
            reference, reference_optimizer, reference_map = delink_and_carry(
                reference, reference_optimizer, delink_plain
            )
        before = counter.snapshot()
        train_step(model, optimizer, input_ids[local])
        collectives["pseudo" if step < STEPS_BEFORE else "real"] = [a - b for a, b in zip(counter.snapshot(), before)]
        train_step(reference, reference_optimizer, input_ids)

    final = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "names": sorted(final) == sorted(name for name, _ in reference.named_parameters()),
        "max_diff": max((final[name] - p).abs().max().item() for name, p in reference.named_parameters()),
        "moved": min((p - initial[reference_map[name]]).abs().max().item() for name, p in reference.named_parameters()),
        "carried": carried,
        "collectives": collectives,
        "shard_bytes": shard_bytes,
    }


def accelerate_wrapping(rank: int, world_size: int) -> dict:
    """The trainer's FSDP2 path minus `Accelerator` itself (which turns FSDP off on CPU): Accelerate's own
    `fsdp2_prepare_model` with the plugin `configs/accelerate/fsdp2.yaml` gives, then `gather_shared_once`,
    training, `delink_fully_sharded` with the same wrapping, training."""
    with mock.patch.dict(os.environ, launch_env("fsdp2")):
        plugin = FullyShardedDataParallelPlugin()
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no", is_main_process=rank == 0
    )

    def shard(model):
        return gather_shared_once(fsdp2_prepare_model(accelerator, model))

    data = batches(STEPS_BEFORE + STEPS_AFTER)
    reference = tiny_model(share_layers=True, num_unique_layers=2).train()
    model = shard(copy.deepcopy(reference))
    counter = CollectiveCounter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    collectives = {}
    for step, input_ids in enumerate(data):
        if step == STEPS_BEFORE:
            model, optimizer, _ = delink_and_carry(model, optimizer, lambda m: delink_fully_sharded(m, shard=shard))
            reference, reference_optimizer, _ = delink_and_carry(reference, reference_optimizer, delink_plain)
        before = counter.snapshot()
        train_step(model, optimizer, input_ids[rank * 2 : rank * 2 + 2])
        collectives["pseudo" if step < STEPS_BEFORE else "real"] = [a - b for a, b in zip(counter.snapshot(), before)]
        train_step(reference, reference_optimizer, input_ids)
    final = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "max_diff": max((final[name] - p).abs().max().item() for name, p in reference.named_parameters()),
        "collectives": collectives,
    }


def both(rank: int, world_size: int) -> dict:
    return {
        "delink": pseudo_through_delink(rank, world_size),
        "schedules": schedules(rank, world_size),
        "accelerate": accelerate_wrapping(rank, world_size),
    }


runs = spawn.shared_run(both, 2)  # one two-process run for the whole file


def test_pseudo_fsdp2_through_delink_matches_one_process(runs):
    result = runs["delink"]
    assert result["names"]
    assert result["carried"]  # the trainer's carry ("scale") on DTensor shards, state_dict round trip included
    assert result["moved"] > 100 * ATOL  # control: every tensor trained far beyond the tolerance
    assert result["max_diff"] < ATOL
    # k=2 blocks at L=8 depths, gathered once: the root and each block one all-gather and one reduce-scatter per
    # step. The real model: root + 8 blocks gathered in the forward and again in the backward, 9 reduce-scatters.
    assert result["collectives"]["pseudo"] == [3, 3]
    assert result["collectives"]["real"] == [17, 9]
    assert result["collectives"]["delink"] == [0, 0]  # delinking gathers nothing
    # The planner's FSDP2 / ZeRO-3 weights per GPU are rank 0's local shards, byte for byte.
    tensors = parameter_tensors(tiny_model(share_layers=True, num_unique_layers=2).config)
    expected = model_state_bytes(tensors, Layout(dp=2, zero=3), PRECISIONS["fp32"]).weights
    assert result["shard_bytes"] == expected


def schedules(rank: int, world_size: int) -> dict:
    """Collectives of one step per schedule, and whether gather-once with activation checkpointing still matches."""
    mesh = init_device_mesh("cpu", (world_size,))
    input_ids = batches(1)[0]
    output = {}
    for name, gather_once, checkpointing in (("default", False, False), ("checkpointed", True, True)):
        reference = tiny_model(share_layers=True, num_unique_layers=2).train()
        model = copy.deepcopy(reference)
        fully_shard_p2r(model, mesh=mesh, shared_gather_once=gather_once)
        if checkpointing:
            model.activation_checkpointing_enable()
        counter = CollectiveCounter()
        train_step(model, torch.optim.AdamW(model.parameters(), lr=LR), input_ids[rank * 2 : rank * 2 + 2])
        train_step(reference, torch.optim.AdamW(reference.parameters(), lr=LR), input_ids)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        output[name] = {
            "collectives": list(counter.snapshot()),
            "max_diff": max((full[n] - p).abs().max().item() for n, p in reference.named_parameters()),
        }
    return output


def test_accelerate_fsdp2_wrapping_through_delink_matches_one_process(runs):
    result = runs["accelerate"]
    assert result["max_diff"] < ATOL
    # Accelerate's units: the embedding (gathered forward and again backward), the tail (final norm + head, kept
    # gathered), the blocks; the root keeps no parameter. Pseudo: the two shared blocks gathered once each.
    assert result["collectives"]["pseudo"] == [2 + 2 + 1, 1 + 2 + 1]
    assert result["collectives"]["real"] == [2 + 2 * 8 + 1, 1 + 8 + 1]


def test_schedules(runs):
    result = runs["schedules"]
    # Without gather_shared_once FSDP2 gathers a shared block at every use: root 1 + 8 depths forward + 8 backward.
    # Reduce-scatters stay one per unit: autograd sums a parameter's gradient over its uses before FSDP2's
    # post-backward hook sees it.
    assert result["default"]["collectives"] == [17, 3]
    # Activation checkpointing recomputes each depth in the backward; the shared blocks are still gathered once.
    assert result["checkpointed"]["collectives"] == [3, 3]
    assert result["default"]["max_diff"] < ATOL and result["checkpointed"]["max_diff"] < ATOL
