"""PipeDream-2BW's error-feedback delay correction and `optimizer: muon` in pipelines, on CPU processes (gloo).

Two processes: 2BW with `delay_correction="error_feedback"` equals a one-process run of W(t+1) = W(t) + d(t) +
(d(t) - d(t-1)) (d: the optimizer's update from the gradient at W(t-1)), under AdamW (real and cycle models) and
under MuonAdamW (real); the correction changes the weights (control); the trainer runs 2BW + Muon + the correction
through a delink and resumes exactly; a 1F1B pipeline under Muon with growth (1 -> 2 -> 4 blocks, shared_lr_scale:
depth) gives the one-process trainer's losses; sharded stages refuse Muon in one line. Four processes: two
data-parallel pipelines of replicated stages train 2BW + Muon + the correction through a delink and resume exactly.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from hf_p2r.distributed.pipeline import build_pipeline, delink_stages, pipeline_mesh
from hf_p2r.training import TrainArguments
from hf_p2r.training.config import ConfigError
from hf_p2r.training.optim import build_optimizer

from . import spawn
from .test_pipeline import (
    GROWTH,
    SEQ,
    TRAINER,
    accumulate,
    adamw,
    assert_same_losses,
    batches,
    last_stage_value,
    model_of,
    one_process_losses,
    trainer_with_resumes,
    worst_difference,
)

ATOL = 1e-5  # as test_pipeline: a shared block's gradient summed in another order, amplified by AdamW
MUON = TrainArguments(optimizer="muon", learning_rate=1e-2, weight_decay=0.1)
CORRECTED = {**TRAINER, "optimizer": "muon", "pipeline_delay_correction": "error_feedback"}


def corrected_reference(pattern: str, data, microbatches: int, make_optimizer, correct: bool = True):
    """One process: W(t+1) = W(t) + d(t) + (d(t) - d(t-1)), d(t) the optimizer's update from grad f_t(W(t-1)),
    W(-1) = W(0), no correction at the first update; returns the model and the losses."""
    model = model_of(pattern)
    optimizer = make_optimizer(model)
    previous, last_update, losses = copy.deepcopy(model), None, []
    for ids in data:
        previous.zero_grad()
        losses.append(accumulate(previous, ids, microbatches))
        snapshot = copy.deepcopy(model.state_dict())
        before = [param.detach().clone() for param in model.parameters()]
        for param, used in zip(model.parameters(), previous.parameters(), strict=True):
            param.grad = used.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            update = [param - old for param, old in zip(model.parameters(), before, strict=True)]
            if correct and last_update is not None:
                for param, new, old in zip(model.parameters(), update, last_update, strict=True):
                    param.add_(new - old)
        last_update = update
        previous.load_state_dict(snapshot)
    return model, losses


def corrected_2bw(world: int, pattern: str, optimizer: str, steps: int = 4) -> tuple[float, float, float]:
    """(largest weight difference to the corrected reference, largest loss difference, largest difference to the
    uncorrected reference: the control)."""
    microbatches = world
    data = batches(steps, 2 * microbatches)
    pipeline = build_pipeline(
        model_of(pattern), schedule="2bw", num_microbatches=microbatches, seq_len=SEQ, delay_correction="error_feedback"
    )
    pipeline.optimizer = adamw(pipeline.parameters()) if optimizer == "adamw" else build_optimizer(pipeline, MUON)
    losses = [pipeline.step(ids) for ids in data]
    pipeline.drain()

    def make(model):
        return adamw(model.parameters()) if optimizer == "adamw" else build_optimizer(model, MUON)

    reference, reference_losses = corrected_reference(pattern, data, microbatches, make)
    plain, _ = corrected_reference(pattern, data, microbatches, make, correct=False)
    mine = list(pipeline.named_parameters())
    weights, uncorrected = dict(reference.named_parameters()), dict(plain.named_parameters())
    loss_gap = max(
        abs(last_stage_value(None if loss is None else loss.item()) - expected)
        for loss, expected in zip(losses, reference_losses, strict=True)
    )
    return (
        worst_difference((param, weights[name]) for name, param in mine),
        loss_gap,
        worst_difference((param, uncorrected[name]) for name, param in mine),
    )


def delinked_previous_updates(world: int) -> dict:
    """2BW + correction on a cycle model, 2 steps, then the delink: each new weight's d(t-1) is its source's (the
    update the shared block received last), a copy of its own; and a flush schedule refuses the correction."""
    pipeline = build_pipeline(
        model_of("cycle"), schedule="2bw", num_microbatches=world, seq_len=SEQ, delay_correction="error_feedback"
    )
    pipeline.optimizer = adamw(pipeline.parameters())
    for ids in batches(2, 2 * world):
        pipeline.step(ids)
    pipeline.drain()
    schedule = pipeline.schedule
    before = {pipeline.name_of(name): update.clone() for name, update in schedule.previous_update.items()}
    mapping = delink_stages(pipeline)  # {new model name: old model name}
    after = {pipeline.name_of(name): update for name, update in schedule.previous_update.items()}
    pointers = [update.data_ptr() for update in after.values()]
    try:
        build_pipeline(model_of("real"), schedule="1f1b", num_microbatches=world, seq_len=SEQ,
                       delay_correction="error_feedback")  # fmt: skip
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    renamed = torch.tensor(sum(new != old for new, old in mapping.items()))
    dist.all_reduce(renamed)  # the second stage's new blocks 2, 3 start as old blocks 0, 1
    return {
        "same_names": set(after) == set(mapping) and renamed.item() > 0,
        "copied": all(torch.equal(after[new], before[old]) for new, old in mapping.items()),
        "own_buffers": len(set(pointers)) == len(pointers),
        "refusal": refusal,
    }


def sharded_muon_refusal() -> str:
    """A one-stage pipeline sharded over both processes (FSDP2 rows), given Muon: the one-line refusal."""
    mesh = pipeline_mesh(pipeline_parallel_size=1, data_parallel_size=2)
    pipeline = build_pipeline(model_of("real"), schedule="1f1b", num_microbatches=2, seq_len=SEQ, mesh=mesh, shard=True)
    try:
        build_optimizer(pipeline, MUON)
    except ConfigError as error:
        return str(error)
    return ""


def two_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return {
        "adamw/real": corrected_2bw(world, "real", "adamw"),
        "adamw/cycle": corrected_2bw(world, "cycle", "adamw"),
        "muon/real": corrected_2bw(world, "real", "muon"),
        "sharded_refusal": sharded_muon_refusal(),
        "delinked": delinked_previous_updates(world),
        "trainer": trainer_with_resumes(f"{folder}/corrected", CORRECTED, resume_from=(2, 3)),
        "growth": trainer_with_resumes(f"{folder}/growth", {**GROWTH, "optimizer": "muon"}, resume_from=(2,)),
    }


def four_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    fields = {**CORRECTED, "data_parallel_size": 2}
    return {"trainer": trainer_with_resumes(f"{folder}/dp", fields, resume_from=(3,))}


two = spawn.shared_run(two_processes, 2)
four = spawn.shared_run(four_processes, 4)


@pytest.mark.parametrize(("case", "tolerance"), [("adamw/real", 1e-7), ("adamw/cycle", ATOL), ("muon/real", 1e-7)])
def test_2bw_error_feedback_equals_the_one_process_rule(two, case, tolerance):
    weight_difference, loss_difference, to_uncorrected = two[case]
    assert weight_difference < tolerance
    assert loss_difference < 1e-6
    assert to_uncorrected > 100 * tolerance  # control: the correction moved the weights


def test_the_delink_gives_each_new_weight_its_sources_last_update(two):
    result = two["delinked"]
    assert result["same_names"] and result["copied"] and result["own_buffers"]
    assert result["refusal"].startswith("pipeline_delay_correction: corrects PipeDream-2BW's delayed update; 1f1b")


def test_sharded_stages_refuse_muon_in_one_line(two):
    assert two["sharded_refusal"].startswith("optimizer: muon orthogonalizes each matrix whole")


def test_the_trainer_runs_2bw_with_muon_and_the_correction_through_a_delink_and_resumes(two):
    run = two["trainer"]
    assert [step for step, _ in run["full"]] == [1, 2, 3, 4]
    assert run["resumed/2"] == run["full"] and run["resumed/3"] == run["full"]
    assert run["real_blocks"] == 4


def test_a_1f1b_pipeline_under_muon_grows_as_one_process_does(two, tmp_path):
    run = two["growth"]
    assert run["blocks"] == [[1, 1], [2, 2], [3, 4], [4, 4]]
    assert_same_losses(run["full"], one_process_losses(run["argv"], tmp_path))
    assert run["resumed/2"] == run["full"]


def test_data_parallel_2bw_pipelines_with_muon_and_the_correction_resume_exactly(four):
    run = four["trainer"]
    assert [step for step, _ in run["full"]] == [1, 2, 3, 4]
    assert run["resumed/3"] == run["full"]
    assert run["real_blocks"] == 4
