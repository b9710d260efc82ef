"""Run by test_launch.py as `accelerate launch ... -m tests.training.uneven_eval_worker DIR` with two gloo processes:
the Accelerate engine's `evaluate` on an odd number of validation blocks, with a collective in every forward pass, as
under FSDP2 / ZeRO-3 (their parameter all-gather).

Writes `rank{N}.json` into the folder given as the only argument: forward passes run, the validation loss, and the
same loss computed block by block in this one process.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from datasets import Dataset

from hf_p2r import P2RForCausalLM
from hf_p2r.training.engines.accelerate import evaluate

from ..tiny import tiny_config

NUM_BLOCKS, EVAL_BLOCKS, BATCH_SIZE = 40, 9, 4  # process 0 takes 5 blocks (2 batches), process 1 takes 4 (1 batch)
CHOSEN = [0, 4, 8, 13, 17, 22, 26, 31, 35]  # 9 blocks spread evenly over 40


def main(output_dir: Path) -> None:
    # Without equal forward counts one process would wait for the other for good: this timeout ends it (and the test
    # fails). Long enough for the start-up too (it also bounds the wait for the other process to join).
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=5))])
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
        torch.distributed.all_reduce(torch.ones(3))  # every process must join, as in FSDP2's parameter all-gather

    model.register_forward_pre_hook(all_gather_like_fsdp)
    model = accelerator.prepare(model)
    val_loss = evaluate(accelerator, model, blocks, EVAL_BLOCKS, BATCH_SIZE)
    result = {"forwards": forwards, "val_loss": val_loss, "expected": expected.item()}
    (output_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Exit without destroying the gloo process group: its destructor can hang for good when a gloo thread still
    # releases a tensor of the forward hook's collectives (seen once here under load; pytorch/pytorch#190489).
    os._exit(0)
