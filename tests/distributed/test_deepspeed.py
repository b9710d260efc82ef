"""DeepSpeed ZeRO-1/2/3, and ZeRO-Offload at stages 2 and 3 (deepspeed.initialize, gloo, two CPU processes) on a
pseudo model, through delink (`delink_deepspeed`, as the trainer's).

Accelerate's DeepSpeed plugin drives this same engine; on CPU it does not set up several processes, so the
Accelerate path (`configs/accelerate/deepspeed_*.yaml`) runs here in one process (test_deepspeed_zero_init.py) and
with several on GPUs. Skipped without deepspeed
(`pip install hf-p2r[deepspeed]`).
"""

import copy

import pytest
import torch

from hf_p2r.distributed import gather_deepspeed_model
from hf_p2r.distributed.fsdp import delink_deepspeed

from ..conftest import tiny_model
from . import spawn

deepspeed = pytest.importorskip("deepspeed")

STEPS_BEFORE, STEPS_AFTER, LR = 2, 2, 0.5
# fp32, two half-batch means against one full-batch mean. SGD rather than Adam: the optimizer state restarts at the
# delink, and Adam's first step, lr * g / (|g| + eps), would blow rounding differences on tiny gradients up to ~lr.
ATOL = 1e-5


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


# name -> (ZeRO stage, offload): ZeRO-Offload of the optimizer (stage 2) and of parameters too (stage 3, as
# configs/accelerate/deepspeed_zero3_offload.yaml).
STAGES = {
    "1": (1, {}),
    "2": (2, {}),
    "3": (3, {}),
    "2-offload": (2, {"offload_optimizer": {"device": "cpu"}}),
    "3-offload": (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
}


def engine_config(stage: int, offload: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
        "zero_optimization": {"stage": stage, **offload},
        "zero_allow_untested_optimizer": True,  # torch's SGD, as in the single-process reference
        "zero_force_ds_cpu_optimizer": False,  # with offload: torch's SGD steps the CPU state, not DeepSpeedCPUAdam
    }


def zero_stages(rank: int, world_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(3, 101, (4, 12), generator=generator) for _ in range(STEPS_BEFORE + STEPS_AFTER)]
    local = slice(rank * 2, rank * 2 + 2)
    output = {}
    for name, (stage, offload) in STAGES.items():
        reference = tiny_model(share_layers=True, num_unique_layers=2).train()
        initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
        model = copy.deepcopy(reference)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model), config=engine_config(stage, offload))
        reference_optimizer = optimizer(reference)
        for step, input_ids in enumerate(data):
            if step == STEPS_BEFORE:
                real = delink_deepspeed(engine)  # ZeRO-3: into the new partitions; ZeRO-1/2: the gathered copy
                config = engine_config(stage, offload)
                engine, *_ = deepspeed.initialize(model=real, optimizer=optimizer(real), config=config)
                sources = reference.delink_parameter_map()
                reference.delink()  # a new optimizer on both sides (carry "reset")
                reference_optimizer = optimizer(reference)
            engine.backward(engine(input_ids=input_ids[local], labels=input_ids[local]).loss)
            engine.step()
            reference(input_ids=input_ids, labels=input_ids).loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        final = dict(gather_deepspeed_model(engine).named_parameters())
        output[name] = {
            "real": len(final) == len(dict(reference.named_parameters())) and reference.config.share_layers is False,
            "max_diff": max((final[n] - p).abs().max().item() for n, p in reference.named_parameters()),
            "moved": max((p - initial[sources[n]]).abs().max().item() for n, p in reference.named_parameters()),
        }
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return spawn.run(zero_stages, 2, tmp_path_factory.mktemp("deepspeed"))


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_on_pseudo_model_through_delink_matches_one_process(runs, stage):
    result = runs[stage]
    assert result["real"]
    assert result["moved"] > 100 * ATOL  # control: training moved the weights far beyond the tolerance
    assert result["max_diff"] < ATOL
