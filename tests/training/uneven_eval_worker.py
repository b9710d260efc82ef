"""Run by test_launch.py in two spawned gloo processes (tests/distributed/spawn.py): the Accelerate engine's
`evaluate` on an odd number of validation blocks, with a collective in every forward pass, as under FSDP2 / ZeRO-3
(their parameter all-gather).

Returns, for each process: forward passes run, the validation loss, and the same loss computed block by block in
this one process.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from datasets import Dataset

from hf_p2r import P2RForCausalLM
from hf_p2r.training.engines.accelerate import evaluate

from ..tiny import tiny_config

NUM_BLOCKS, EVAL_BLOCKS, BATCH_SIZE = 40, 9, 4  # process 0 takes 5 blocks (2 batches), process 1 takes 4 (1 batch)
CHOSEN = [0, 4, 8, 13, 17, 22, 26, 31, 35]  # 9 blocks spread evenly over 40


def uneven_evaluation(rank: int, world_size: int) -> list[dict]:
    accelerator = Accelerator(cpu=True)  # on the spawner's process group
    # Without equal forward counts one process would wait for the other for good in the forward's collective: this
    # group's timeout ends it (and the test fails).
    collectives = dist.new_group(backend="gloo", timeout=timedelta(minutes=5))
    torch.manual_seed(0)
    model = P2RForCausalLM(tiny_config(vocab_size=64, num_hidden_layers=2, max_position_embeddings=16)).eval()
    ids = torch.randint(0, 64, (NUM_BLOCKS, 16), generator=torch.Generator().manual_seed(1))
    blocks = Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    with torch.no_grad():  # one process, block by block: the mean of the chosen blocks' mean losses
        expected = torch.stack([model(input_ids=ids[i : i + 1], labels=ids[i : i + 1]).loss for i in CHOSEN]).mean()

    forwards = 0

    def all_gather_like_fsdp(module, args):
        nonlocal forwards
        forwards += 1
        dist.all_reduce(torch.ones(3), group=collectives)  # every process must join, as in FSDP2's all-gather

    model.register_forward_pre_hook(all_gather_like_fsdp)
    model = accelerator.prepare(model)
    val_loss = evaluate(accelerator, model, blocks, EVAL_BLOCKS, BATCH_SIZE)
    results = [None] * world_size
    dist.all_gather_object(results, {"forwards": forwards, "val_loss": val_loss, "expected": expected.item()})
    dist.destroy_process_group(collectives)
    return results
