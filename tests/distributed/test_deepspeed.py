"""DeepSpeed ZeRO-1/2/3, and ZeRO-Offload at stages 2 and 3 (deepspeed.initialize, gloo, two CPU processes) on a
pseudo model, through delink (`delink_deepspeed`, as the trainer's); and depth growth of a shallow model under ZeRO-2
and ZeRO-3 (into the new partitions): the grown weights bitwise the one-process `delink(plan)` of the same weights, and
function-preserving growth's loss at the growth step the shallow model's.

Accelerate's DeepSpeed plugin drives this same engine; on CPU it does not set up several processes, so the
Accelerate path (`configs/accelerate/deepspeed_*.yaml`) runs here in one process (test_deepspeed_zero_init.py) and
with several on GPUs. Skipped without deepspeed
(`pip install hf-p2r[deepspeed]`).
"""

import copy

import pytest
import torch

from hf_p2r.distributed import gather_deepspeed_model
from hf_p2r.distributed.deepspeed import delink_deepspeed

from ..conftest import tiny_model
from . import spawn

# The compatibility pass (Makefile COMPAT_TESTS) runs this file on the declared floors and the newest releases too:
# the engine's ZeRO stages and the delink through DeepSpeed's partitions (torch's SGD: no compiled CPU Adam).
pytestmark = [pytest.mark.versions, pytest.mark.usefixtures("deepspeed_ops")]

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


# name -> (ZeRO stage, the shallow model, the growth): unshared stacked, shared with biases interleaved, Depth-µP (its
# kept outputs scaled), and ZeRO-2 (through the gathered copy).
SHALLOW = dict(num_hidden_layers=2, real_num_hidden_layers=4)
SHARED = dict(num_hidden_layers=4, share_layers=True, num_unique_layers=2, real_num_hidden_layers=8, mlp_bias=True)
GROWTH = {
    "3-stack": (3, SHALLOW, dict(num_hidden_layers=4, function_preserving=True)),
    "3-shared-interleave": (3, SHARED, dict(num_hidden_layers=8, growth="interleave", function_preserving=True)),
    "3-depth-mup": (3, {**SHALLOW, "depth_mup": True}, dict(num_hidden_layers=4, function_preserving=True)),
    "2-stack": (2, SHALLOW, dict(num_hidden_layers=4, function_preserving=True)),
}


def growth(rank: int, world_size: int) -> dict:
    """Each GROWTH case trained two steps, then grown by `delink_deepspeed` (a new engine on the grown model) against
    `gather_deepspeed_model(engine).delink(plan)`: the one-process delink of the same weights."""
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(3, 101, (4, 12), generator=generator) for _ in range(3)]
    local = slice(rank * 2, rank * 2 + 2)
    output = {}
    for name, (stage, layout, grow) in GROWTH.items():
        model = tiny_model(**layout).train()
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model), config=engine_config(stage, {}))
        for input_ids in data[:2]:
            engine.backward(engine(input_ids=input_ids[local], labels=input_ids[local]).loss)
            engine.step()
        plan = engine.module.delink_plan(**grow)
        expected = dict(gather_deepspeed_model(engine).delink(plan).named_parameters())
        probe = data[2][local]
        with torch.no_grad():
            shallow = engine(input_ids=probe, labels=probe).loss.item()
        grown = delink_deepspeed(engine, plan)
        partitioned = all(hasattr(p, "ds_id") for p in grown.parameters())
        engine, *_ = deepspeed.initialize(model=grown, optimizer=optimizer(grown), config=engine_config(stage, {}))
        with torch.no_grad():
            after = engine(input_ids=probe, labels=probe).loss.item()
        final = dict(gather_deepspeed_model(engine).named_parameters())
        output[name] = {
            "names": sorted(final) == sorted(expected),
            "differ": [n for n, p in expected.items() if not torch.equal(final[n], p)],
            "layers": [engine.module.config.num_hidden_layers, plan.num_hidden_layers],
            "partitioned": partitioned,
            "losses": [shallow, after],
        }
    return output


runs = spawn.shared_run({"stages": zero_stages, "growth": growth}, 2)  # one two-process run for the whole file


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_on_pseudo_model_through_delink_matches_one_process(runs, stage):
    result = runs["stages"][stage]
    assert result["real"]
    assert result["moved"] > 100 * ATOL  # control: training moved the weights far beyond the tolerance
    assert result["max_diff"] < ATOL


@pytest.mark.parametrize("case", GROWTH)
def test_growth_under_zero_equals_the_one_process_delink_bitwise_and_keeps_the_loss(runs, case):
    result = runs["growth"][case]
    assert result["names"] and result["differ"] == []
    assert result["layers"][0] == result["layers"][1] > GROWTH[case][1]["num_hidden_layers"]
    assert result["partitioned"] == (GROWTH[case][0] == 3)  # ZeRO-3: straight into the new partitions
    shallow, grown = result["losses"]
    if "mup" in case:  # Depth-µP: the kept outputs times sqrt(L'/d), equal to rounding
        assert grown == pytest.approx(shallow, rel=1e-6)
    else:
        assert grown == shallow
