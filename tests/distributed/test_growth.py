"""Depth growth of a model held in pieces (issue 39): FSDP2 shards (`delink_fully_sharded`) and pipeline stages
(`delink_stages`, replicated and FSDP2-sharded, 2BW's second weight version), on two gloo CPU processes, against the
one-process `model.delink(plan)` and the trainer's carry applied to the same weights and optimizer state gathered:
the grown weights and every carried optimizer state bitwise, and function-preserving growth's loss at the growth step
bitwise the shallow model's (to rounding under Depth-µP). DeepSpeed ZeRO-3's growth is in test_deepspeed.py.

`grown_split` (plain Python): interleave growth keeps each stage's copies on it for any split, stack growth over
several stages is refused in one line.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hf_p2r import P2RForCausalLM
from hf_p2r.distributed import delink_fully_sharded, fully_shard_p2r
from hf_p2r.distributed.pipeline import build_pipeline, pipeline_mesh, pipeline_model_config
from hf_p2r.distributed.pipeline.split import grown_split, stage_depths
from hf_p2r.models.p2r import plan_delink, source_depths
from hf_p2r.training.carry import CARRIES, ParameterSnapshot, carry_optimizer_state
from hf_p2r.training.delink import delink_pipeline

from ..conftest import tiny_config, tiny_model
from . import spawn

LR = 1e-2
ATOL = 1e-5  # one step after the growth: two half-batch means against one full-batch mean (fp32, AdamW)
# name -> (the shallow model, the growth): unshared stacked, shared with biases interleaved, a growth that keeps the
# blocks shared (not function-preserving: a shared block would run at kept and at zeroed depths), Depth-µP.
SHALLOW = dict(num_hidden_layers=2, real_num_hidden_layers=4)  # unshared, 2 of its 4 layers
SHARED = dict(num_hidden_layers=4, share_layers=True, num_unique_layers=2, real_num_hidden_layers=8)
FSDP2_CASES = {
    "stack": (SHALLOW, dict(num_hidden_layers=4, function_preserving=True)),
    "shared-interleave": (
        {**SHARED, "mlp_bias": True, "attention_bias": True},
        dict(num_hidden_layers=8, growth="interleave", function_preserving=True),
    ),
    "shared-kept": (SHARED, dict(num_unique_layers=2, num_hidden_layers=8)),
    "depth-mup": (
        {**SHALLOW, "depth_mup": True},
        dict(num_hidden_layers=4, growth="interleave", function_preserving=True),
    ),
}
# name -> (the shallow model, the growth, the split before, build_pipeline's mesh and shard): two replicated stages
# growing by interleave; two stages stacking a fully shared block (every stage holds it); the whole model as one stage
# FSDP2-sharded over both processes, stacked.
PIPELINE_CASES = {
    "interleave": (SHALLOW, dict(growth="interleave"), [1, 1], False),
    "shared-stack": ({**SHARED, "num_unique_layers": 1}, {}, [2, 2], False),
    "one-stage-sharded": (SHALLOW, {}, [2], True),
}


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 101, (4, 12), generator=generator) for _ in range(steps)]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=LR)


def full(tensor):
    """A whole tensor from a DTensor (a collective: every process in the same order); others as they are."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def one_process(config, weights: dict, states: dict) -> tuple[P2RForCausalLM, torch.optim.Optimizer]:
    """A plain model of `config` holding `weights` and an AdamW holding `states` ({name: state}), as one process would
    have them."""
    model = P2RForCausalLM(copy.deepcopy(config)).train()
    model.load_state_dict(weights, strict=False)
    optimizer = adamw(model.parameters())
    for name, param in model.named_parameters():
        if name in states:
            optimizer.state[param] = {key: value.clone() for key, value in states[name].items()}
    return model, optimizer


def one_process_growth(model, optimizer, plan, carry: str) -> tuple[P2RForCausalLM, torch.optim.Optimizer]:
    """The one-process delink and the trainer's carry (`delink_with_optimizer`'s steps) on copies."""
    model, optimizer = copy.deepcopy((model, optimizer))
    before, mapping = ParameterSnapshot.of(model), model.delink_parameter_map(plan)
    model.delink(plan)
    new_optimizer = adamw(model.parameters())
    carry_optimizer_state(optimizer, new_optimizer, before, ParameterSnapshot.of(model), mapping, carry)
    return model, new_optimizer


def differences(named_parameters, optimizer, reference, reference_optimizer) -> list[str]:
    """Names whose weight or optimizer state (every key) is not bitwise the reference's, on this process."""
    expected = dict(reference.named_parameters())
    wrong = []
    for name, param in named_parameters:
        state = {key: full(value) for key, value in optimizer.state.get(param, {}).items()}
        reference_state = reference_optimizer.state.get(expected[name], {})
        if not torch.equal(full(param.detach()), expected[name].detach()) or state.keys() != reference_state.keys():
            wrong.append(name)
        elif not all(torch.equal(state[key], reference_state[key]) for key in state):
            wrong.append(name)
    return wrong


def everywhere(wrong: list[str]) -> list[str]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, wrong)
    return sorted({name for names in gathered for name in names})


def fsdp2_growth(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    shard = functools.partial(fully_shard_p2r, mesh=mesh)
    data = batches(4)
    local = slice(rank * 2, rank * 2 + 2)
    out = {}
    for case, (layout, growth) in FSDP2_CASES.items():
        model = shard(tiny_model(**layout).train())
        optimizer = adamw(model.parameters())
        for ids in data[:2]:
            model(input_ids=ids[local], labels=ids[local]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        growth = dict(growth)
        plan = model.delink_plan(growth.pop("num_unique_layers", None), **growth)
        weights = {name: full(param.detach()) for name, param in model.named_parameters()}
        states = {
            name: {key: full(value) for key, value in optimizer.state[param].items()}
            for name, param in model.named_parameters()
        }
        whole, whole_optimizer = one_process(model.config, weights, states)
        probe = data[2][local]
        with torch.no_grad():  # (an evaluation just before the delink leaves the root gathered: the delink reshards)
            shallow_loss = model(input_ids=probe, labels=probe).loss
        wrong = {}
        for carry in CARRIES:
            new, mapping = delink_fully_sharded(model, plan, shard=shard)
            new_optimizer = adamw(new.parameters())
            after = ParameterSnapshot.of(new)
            carry_optimizer_state(optimizer, new_optimizer, ParameterSnapshot.of(model), after, mapping, carry)
            reference, reference_optimizer = one_process_growth(whole, whole_optimizer, plan, carry)
            wrong[carry] = differences(new.named_parameters(), new_optimizer, reference, reference_optimizer)
        with torch.no_grad():
            grown_loss = new(input_ids=probe, labels=probe).loss
        # The grown model (carry "scale") trains on: one step, against one process on the whole batch.
        new(input_ids=data[3][local], labels=data[3][local]).loss.backward()
        new_optimizer.step()
        reference(input_ids=data[3], labels=data[3]).loss.backward()
        reference_optimizer.step()
        expected = dict(reference.named_parameters())
        out[case] = {
            "wrong": wrong,
            "layers": [new.config.num_hidden_layers, len(new.model.layers)],
            "planned": [plan.num_hidden_layers, plan.num_unique_layers],
            "losses": [shallow_loss.item(), grown_loss.item()],
            "step": max((full(p.detach()) - expected[n]).abs().max().item() for n, p in new.named_parameters()),
            "sharded": all(isinstance(p, DTensor) for p in new.parameters()),
        }
    return out


def pipeline_everything(pipeline, optimizer) -> tuple[dict, dict]:
    """The whole model's weights and optimizer state ({name: state}) from every process's stages."""
    weights = {name: full(param.detach()) for name, param in pipeline.named_parameters()}
    states = {
        name: {key: full(value) for key, value in optimizer.state.get(param, {}).items()}
        for name, param in pipeline.named_parameters()
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (weights, states))
    return {k: v for w, _ in everyone for k, v in w.items()}, {k: v for _, s in everyone for k, v in s.items()}


def pipeline_growth(rank: int, world: int) -> dict:
    data = batches(4)
    out = {}
    for case, (layout, growth, split, sharded) in PIPELINE_CASES.items():
        mesh = pipeline_mesh(1, world) if sharded else None  # one stage, data parallel over both processes
        model = tiny_model(**layout).train()
        depth = model.config.real_depth
        pipeline = build_pipeline(
            model, schedule="1f1b", num_microbatches=2, split=split, seq_len=12, optimizer_factory=adamw,
            mesh=mesh, shard=sharded,
        )  # fmt: skip
        local = slice(None) if mesh is None else slice(rank * 2, rank * 2 + 2)  # data parallel: half the batch each
        for ids in data[:2]:
            pipeline.step(ids[local])
            pipeline.update()
        plan = plan_delink(pipeline.config, num_hidden_layers=depth, function_preserving=True, **growth)
        shallow_loss = pipeline.evaluate([data[2]])
        weights, states = pipeline_everything(pipeline, pipeline.optimizer)
        whole, whole_optimizer = one_process(pipeline_model_config(pipeline), weights, states)
        reference, reference_optimizer = one_process_growth(whole, whole_optimizer, plan, "scale")
        optimizer = delink_pipeline(pipeline, pipeline.optimizer, adamw, "scale", plan)
        grown_loss = pipeline.evaluate([data[2]])
        wrong = everywhere(differences(pipeline.named_parameters(), optimizer, reference, reference_optimizer))
        pipeline.step(data[3][local])
        pipeline.update()
        chunks = data[3].chunk(2 if mesh is None else 4)  # the micro-batches of both processes
        for chunk in chunks:
            (reference(input_ids=chunk, labels=chunk).loss / len(chunks)).backward()
        reference_optimizer.step()
        expected = dict(reference.named_parameters())
        step = max((full(p.detach()) - expected[n]).abs().max().item() for n, p in pipeline.named_parameters())
        out[case] = {
            "wrong": wrong,
            "split": [split, list(pipeline.split)],
            "losses": None if shallow_loss is None else [shallow_loss[0].item(), grown_loss[0].item()],
            "step": step,
        }
        if rank == 0:  # the last stage's losses: rank 1's with two stages
            gathered = [None] * world
            dist.gather_object(out[case]["losses"], gathered)
            out[case]["losses"] = next(losses for losses in gathered[::-1] if losses is not None)
        else:
            dist.gather_object(out[case]["losses"])
    out["refused"] = refused_stack(data)
    out["2bw"] = second_version(data)
    return out


def refused_stack(data) -> dict:
    """Stacking an unshared model over two stages: one line, nothing changed."""
    pipeline = build_pipeline(
        tiny_model(**SHALLOW).train(), schedule="1f1b", num_microbatches=2,
        split=[1, 1], seq_len=12, optimizer_factory=adamw,
    )  # fmt: skip
    pipeline.step(data[0])
    pipeline.update()
    before = {name: param.detach().clone() for name, param in pipeline.named_parameters()}
    plan = plan_delink(pipeline.config, num_hidden_layers=4)
    try:
        delink_pipeline(pipeline, pipeline.optimizer, adamw, "scale", plan)
        message = None
    except ValueError as error:
        message = str(error)
    after = dict(pipeline.named_parameters())
    unchanged = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    depth = pipeline.config.num_hidden_layers
    return {"message": message, "unchanged": unchanged and pipeline.split == [1, 1], "depth": depth}


def second_version(data) -> bool:
    """PipeDream-2BW keeps an older weight version beside the module's: growth starts it by the same rule (each new
    weight its source's older version, function-preserving growth's residual outputs zeroed), bitwise."""
    pipeline = build_pipeline(
        tiny_model(**SHALLOW).train(), schedule="2bw", num_microbatches=2,
        split=[1, 1], seq_len=12, optimizer_factory=adamw,
    )  # fmt: skip
    for ids in data[:2]:
        pipeline.step(ids)
    pipeline.drain()
    schedule = pipeline.schedule
    older = {name: param.detach().clone() for name, param in schedule.versions[1 - schedule.installed].items()}
    plan = plan_delink(pipeline.config, num_hidden_layers=4, growth="interleave", function_preserving=True)
    delink_pipeline(pipeline, pipeline.optimizer, adamw, "scale", plan)
    grown = schedule.versions[1 - schedule.installed]
    zeroed = 0
    for name, param in grown.items():
        parts = name.split(".", 2)
        source = f"layers.{plan.sources[int(parts[1])]}.{parts[2]}" if parts[0] == "layers" else name
        if not torch.equal(param, plan.start_copy(name, older[source].clone())):
            return False
        zeroed += bool(param.count_nonzero() == 0)
    return zeroed == 2 and len(grown) == len(dict(pipeline.modules[0].named_parameters()))  # o_proj, down_proj


runs = spawn.shared_run({"fsdp2": fsdp2_growth, "pipeline": pipeline_growth}, 2)  # one two-process run for the file


@pytest.mark.parametrize("case", FSDP2_CASES)
def test_fsdp2_growth_equals_one_process_delink_and_carry_bitwise(runs, case):
    run = runs["fsdp2"][case]
    assert run["wrong"] == {carry: [] for carry in CARRIES}  # weights and every carried state, bitwise
    assert run["layers"] == run["planned"] and run["planned"][0] > FSDP2_CASES[case][0]["num_hidden_layers"]
    assert run["sharded"]
    assert run["step"] < ATOL  # the grown sharded model trains as one process does


@pytest.mark.parametrize("case", ["stack", "shared-interleave"])
def test_fsdp2_function_preserving_growth_keeps_the_loss_bitwise(runs, case):
    shallow, grown = runs["fsdp2"][case]["losses"]
    assert shallow == grown


def test_fsdp2_function_preserving_growth_under_depth_mup_keeps_the_loss_to_rounding(runs):
    shallow, grown = runs["fsdp2"]["depth-mup"]["losses"]
    assert grown == pytest.approx(shallow, rel=1e-6)


@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_pipeline_growth_equals_one_process_delink_and_carry_and_keeps_the_loss(runs, case):
    run = runs["pipeline"][case]
    assert run["wrong"] == []
    before, after = run["split"]
    assert sum(after) == 2 * sum(before) and len(after) == len(before)
    shallow, grown = run["losses"]
    assert shallow == grown  # function-preserving: the loss at the growth step, bitwise
    assert run["step"] < ATOL


def test_pipeline_stacking_over_stages_is_refused_in_one_line_and_changes_nothing(runs):
    run = runs["pipeline"]["refused"]
    assert run["message"].startswith("pipeline parallelism: growing 2 -> 4 layers gives stage 0 layer 1, a copy of ")
    assert "\n" not in run["message"] and "'interleave'" in run["message"] and "hf-p2r convert" in run["message"]
    assert run["unchanged"] and run["depth"] == 2


def test_2bw_second_weight_version_grows_by_the_same_rule(runs):
    assert runs["pipeline"]["2bw"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(1, 3), st.integers(1, 3))
def test_interleave_growth_keeps_every_copy_on_its_stage(split, factor, extra):
    depth = sum(split)
    config = tiny_config(num_hidden_layers=depth, real_num_hidden_layers=depth * factor + extra)
    plan = plan_delink(config, num_hidden_layers=config.real_depth, growth="interleave")
    grown = grown_split(config, split, plan)
    assert len(grown) == len(split) and min(grown) >= 1 and sum(grown) == plan.num_hidden_layers
    sources = source_depths(depth, plan.num_hidden_layers, "interleave")
    for old, new in zip(stage_depths(split), stage_depths(grown), strict=True):
        assert all(sources[layer] in old for layer in new)


def test_stack_growth_goes_on_one_stage_and_is_refused_over_several():
    config = tiny_config(num_hidden_layers=3, real_num_hidden_layers=6)
    plan = plan_delink(config, num_hidden_layers=6)
    assert grown_split(config, [3], plan) == [6]
    with pytest.raises(ValueError, match=r"^pipeline parallelism: growing 3 -> 6 layers gives stage 0 layer 1, "):
        grown_split(config, [1, 2], plan)
