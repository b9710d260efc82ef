"""transformers' expert parallelism (`DistributedConfig(ep_size=2)`) on P2R MoE models, two CPU processes (gloo).

The plan comes from the config (`base_model_ep_plan`: the 3-D experts sharded on the expert dimension, tokens sent to
their experts' rank by `ep_dispatch_experts`): each rank holds half the experts of every stored block, and a pseudo
model's shared block still runs at every depth. transformers lays the experts over `fsdp_size * tp_size` ranks, so EP
runs here with `fsdp_size=2` (FSDP2 over the dense parameters); `from_pretrained(pseudo, share_layers=False)` and
`delink()` in memory refuse a model transformers distributes, so the real model is the converted checkpoint
(`hf-p2r convert`), loaded with EP.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

from hf_p2r import convert_pseudo_to_real
from hf_p2r.models.p2r.modeling_p2r_moe import P2RMoeForCausalLM

from ..models.test_modeling_p2r_moe import moe_model
from . import spawn

ATOL = 1e-5  # fp32; experts' outputs summed in another order, FSDP averages the gradients


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def expert_parallel_runs(rank: int, world_size: int) -> dict:
    # Each rank its own batch (data parallel), and the same one on both (the gradients then equal one process's).
    own = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
    shared = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    folders = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folders, src=0)
    pseudo_dir = folders[0]
    if rank == 0:
        moe_model(share_layers=True, num_unique_layers=2).save_pretrained(f"{pseudo_dir}/pseudo")
        convert_pseudo_to_real(f"{pseudo_dir}/pseudo", f"{pseudo_dir}/real", progress=False)
    dist.barrier()
    parallel = DistributedConfig(fsdp_size=2, ep_size=2)
    output = {}
    pseudo = P2RMoeForCausalLM.from_pretrained(f"{pseudo_dir}/pseudo").eval()  # one process
    for name in ("pseudo", "real"):
        reference = P2RMoeForCausalLM.from_pretrained(f"{pseudo_dir}/{name}").train()  # one process
        model = P2RMoeForCausalLM.from_pretrained(f"{pseudo_dir}/{name}", distributed_config=parallel).train()
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            logits = (model(input_ids=own).logits - pseudo(input_ids=own).logits).abs().max().item()
        out, expected = model(input_ids=shared, labels=shared), reference(input_ids=shared, labels=shared)
        out.loss.backward()
        expected.loss.backward()
        reference_grads = dict(reference.named_parameters())
        try:
            model.delink()
            refused = None
        except ValueError as error:
            refused = str(error)
        output[name] = {
            "delink": refused,
            "logits": logits,
            "loss": abs(out.loss.item() - expected.loss.item()),
            "grads": max(
                (full(p.grad) - reference_grads[n].grad).abs().max().item() for n, p in model.named_parameters()
            ),
            "blocks": len(model.model.layers),
            "local_experts": experts.num_experts,
            "local_gate_up": list(experts.gate_up_proj.to_local().shape),
        }
    return output


runs = spawn.shared_run(expert_parallel_runs, 2)


@pytest.mark.parametrize("name", ["pseudo", "real"])
def test_expert_parallel_matches_one_process(runs, name):
    run = runs[name]
    assert run["blocks"] == (2 if name == "pseudo" else 8)
    assert run["local_experts"] == 2 and run["local_gate_up"] == [2, 96, 32], "half the experts on each rank"
    assert run["logits"] <= ATOL, "each rank's own batch: the pseudo model's logits, before and after the delink"
    assert run["loss"] <= ATOL and run["grads"] <= ATOL, "the same batch on both ranks: one process's gradients"
    if name == "pseudo":  # in memory, the copies would run the original block's experts: refused in one line
        assert run["delink"].startswith("delink() of a model distributed by transformers") and "\n" not in run["delink"]
    else:
        assert run["delink"] == "this model is already real (share_layers=False): there is nothing to delink"
