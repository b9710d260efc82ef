"""Pipeline parallelism (hf_p2r.distributed.pipeline, pipedream) on CPU processes (gloo) against one process.

One launch of two processes and one of four run every check (process start-up dominates the time): torch's flush
schedules equal one-process gradient accumulation over the same micro-batches, for the real model, both pseudo
patterns and a tied head; cycle replicas stay bitwise equal; PipeDream-2BW's weights equal a one-process run of
W(t+1) = W(t) - step(grad f_t(W(t-1))) with the same AdamW, with never more than two weight versions; the delink inside
a pipelined run equals the one-process trainer's delink (optimizer state carried); a resumed run gives the same losses
before and after the delink; the real model's weights gathered into one folder load with `from_pretrained`. Four
processes also run two data-parallel pipelines of two stages (a 2-D mesh), with replicated and with FSDP2-sharded
stages: training, 2BW, the delink and a checkpoint equal one process on the whole batch.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from hf_p2r import P2RForCausalLM
from hf_p2r.checkpoint import save_model
from hf_p2r.distributed.pipeline import (
    balanced_split,
    build_pipeline,
    check_split,
    explain_split,
    gather_state_dict,
    load_pipeline_state,
    pipeline_mesh,
    pipeline_model_config,
    pipeline_state,
)
from hf_p2r.distributed.pipeline.split import BYTES_PER_PARAMETER, stage_cost
from hf_p2r.models.p2r.inventory_p2r import inventory
from hf_p2r.training import parse_config, train
from hf_p2r.training.carry import ParameterSnapshot, carry_optimizer_state
from hf_p2r.training.delink import delink_pipeline
from hf_p2r.training.metrics import read_metrics

from ..conftest import tiny_config
from ..training.helpers import TWO_STAGES, tiny_argv
from . import spawn

SEQ, LR = 16, 1e-2
# fp32 CPU. A pseudo model's shared-block gradient is summed over the processes (and in one process over all depths)
# in another order; AdamW's division by sqrt(v) amplifies that last-bit difference on tiny gradients.
ATOL = 1e-5
PATTERNS = {
    "real": {},
    "sequence": dict(share_layers=True, num_unique_layers=2, sharing_pattern="sequence"),
    "cycle": dict(share_layers=True, num_unique_layers=2, sharing_pattern="cycle"),
    "tied": dict(tie_word_embeddings=True),
    "giant": dict(share_layers=True, num_unique_layers=1, sharing_pattern="cycle"),  # M6-10T's fully shared model
}
FLUSH_PATTERNS = ("real", "sequence", "cycle", "tied")
TRAINER = dict(
    TWO_STAGES,
    pipeline_schedule="2bw",
    pseudo_steps=2,
    real_steps=2,
    save_steps=1,
    eval_steps=0,
    cpu="true",
)
# The recommended P2R schedule (growth from one block, shared blocks at 1/n of the rate), pipelined with 1F1B:
# 1 -> 2 blocks at step 1, -> 4 (real) at step 2.
GROWTH = {
    **TRAINER,
    "pipeline_schedule": "1f1b",
    "num_unique_layers": 1,
    "partial_delink_steps": [1],
    "partial_delink_blocks": [2],
    "shared_lr_scale": "depth",
}
PIPELINE_FIELDS = ("pipeline_parallel_size", "pipeline_schedule", "num_microbatches", "data_parallel_size",
                   "data_parallel_shard")  # fmt: skip


def model_of(pattern: str, layers: int = 4) -> P2RForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(vocab_size=64, num_hidden_layers=layers, **PATTERNS[pattern])
    return P2RForCausalLM(config).train()


def batches(count: int, size: int) -> list[torch.Tensor]:
    return [torch.randint(0, 64, (size, SEQ), generator=torch.Generator().manual_seed(seed)) for seed in range(count)]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=LR)


def accumulate(model: P2RForCausalLM, ids: torch.Tensor, microbatches: int) -> float:
    """One-process gradient accumulation over the micro-batches (mean); returns the mean loss."""
    total = 0.0
    for chunk in ids.chunk(microbatches):
        loss = model(input_ids=chunk, labels=chunk).loss / microbatches
        loss.backward()
        total += loss.item()
    return total


def worst_difference(pairs) -> float:
    """The largest |a - b| over (a, b) pairs, the maximum over the processes."""
    worst = max((float((a - b).detach().abs().max()) for a, b in pairs), default=0.0)
    value = torch.tensor(worst)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def last_stage_value(value: float | None) -> float:
    """A number known on the last stage, on every process."""
    out = torch.tensor([-math.inf if value is None else value])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.item()


def flush_schedules(world: int) -> dict:
    """{pattern/schedule: (largest gradient difference, loss difference)} against one-process accumulation."""
    out = {}
    microbatches = 2 * world
    ids = batches(1, 2 * microbatches)[0]
    for pattern in FLUSH_PATTERNS:
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
            if pattern == "sequence" and schedule in ("interleaved_1f1b", "zero_bubble"):
                continue  # 2 blocks cannot make 2 * world stages that keep each block on one stage
            pipeline = build_pipeline(model_of(pattern), schedule=schedule, num_microbatches=microbatches, seq_len=SEQ)
            loss = pipeline.step(ids)
            reference = model_of(pattern)
            reference_loss = accumulate(reference, ids, microbatches)
            grads = dict(reference.named_parameters())
            difference = worst_difference((param.grad, grads[name].grad) for name, param in pipeline.named_parameters())
            out[f"{pattern}/{schedule}"] = (
                difference,
                abs(last_stage_value(None if loss is None else loss.item()) - reference_loss),
            )
    return out


def replicas_stay_equal(world: int, pattern: str = "cycle") -> bool:
    """A cycle pseudo model trained 3 steps under 1F1B: every process's copy of block 0 is bitwise the same."""
    pipeline = build_pipeline(model_of(pattern), schedule="1f1b", num_microbatches=world, seq_len=SEQ)
    optimizer = adamw(pipeline.parameters())
    for ids in batches(3, 2 * world):
        pipeline.step(ids)
        optimizer.step()
        optimizer.zero_grad()
    mine = torch.cat(
        [
            param.detach().reshape(-1)
            for name, param in sorted(pipeline.named_parameters())
            if name.startswith("model.layers.0.")
        ]
    )
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def delayed_reference(pattern: str, data: list[torch.Tensor], microbatches: int) -> tuple[P2RForCausalLM, list[float]]:
    """One process applying W(t+1) = W(t) - AdamW(grad f_t(W(t-1))), W(-1) = W(0)."""
    model = model_of(pattern)
    optimizer = adamw(model.parameters())
    previous = copy.deepcopy(model)
    losses = []
    for ids in data:
        previous.zero_grad()
        losses.append(accumulate(previous, ids, microbatches))
        snapshot = copy.deepcopy(model.state_dict())
        for param, used in zip(model.parameters(), previous.parameters(), strict=True):
            param.grad = used.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        previous.load_state_dict(snapshot)
    return model, losses


def pipedream_2bw(world: int, patterns=("real", "cycle"), steps: int = 4) -> dict:
    """{pattern: (largest weight difference to the delayed-update reference, loss difference, most live versions)}."""
    out = {}
    microbatches = world
    data = batches(steps, 2 * microbatches)
    for pattern in patterns:
        pipeline = build_pipeline(
            model_of(pattern), schedule="2bw", num_microbatches=microbatches, seq_len=SEQ, optimizer_factory=adamw
        )
        schedule, most = pipeline.schedule, [0]
        schedule.observer = lambda schedule=schedule, most=most: most.__setitem__(
            0, max(most[0], schedule.live_versions())
        )
        losses = [pipeline.step(ids) for ids in data]
        schedule.drain()
        reference, reference_losses = delayed_reference(pattern, data, microbatches)
        weights = dict(reference.named_parameters())
        difference = worst_difference((param, weights[name]) for name, param in pipeline.named_parameters())
        loss_gap = max(
            abs(last_stage_value(None if loss is None else loss.item()) - expected)
            for loss, expected in zip(losses, reference_losses, strict=True)
        )
        versions = torch.tensor(most[0])
        dist.all_reduce(versions, op=dist.ReduceOp.MAX)
        out[pattern] = (difference, loss_gap, int(versions))
    return out


def run_with_delink(
    schedule: str, world: int, stop: int | None = None, state=None, before: int = 2, after: int = 2, mesh=None, **kw
):
    """Cycle pseudo model: `before` steps, delink (optimizer_carry scale), `after` steps; returns (losses on every
    process, pipeline, optimizer). With `stop`, returns after that many steps (with the state to resume from);
    with `state` (a (step, saved) pair), resumes from it. With `mesh` (2 x 2), two pipelines each take half of
    every batch (`kw`: build_pipeline's, e.g. shard)."""
    pipelines = 1 if mesh is None else mesh.size(0)
    microbatches = world // pipelines
    pipeline = build_pipeline(
        model_of("cycle"),
        schedule=schedule,
        num_microbatches=microbatches,
        seq_len=SEQ,
        optimizer_factory=adamw,
        mesh=mesh,
        **kw,
    )
    optimizer = pipeline.optimizer  # made by optimizer_factory; 2BW steps it inside its schedule
    first = 0
    if state is not None:
        first, saved = state
        if first > before:
            optimizer = delink_pipeline(pipeline, optimizer, adamw, "scale")
        load_pipeline_state(pipeline, optimizer, saved)
    losses = []
    for step, ids in enumerate(batches(before + after, 2 * microbatches * pipelines)):
        if step < first:
            continue
        if step == before:
            optimizer = delink_pipeline(pipeline, optimizer, adamw, "scale")
        loss = pipeline.step(ids.chunk(pipelines)[pipeline.data_rank])
        if schedule != "2bw":
            optimizer.step()
            optimizer.zero_grad()
        losses.append(mean_loss(loss))
        if stop is not None and step + 1 == stop:
            return losses, (stop, pipeline_state(pipeline, optimizer))
    if schedule == "2bw":
        pipeline.schedule.drain()
    return losses, pipeline, optimizer


def mean_loss(loss: torch.Tensor | None) -> float:
    """The mean of the last stages' losses (one per pipeline), on every process."""
    out = torch.tensor([0.0 if loss is None else loss.item(), float(loss is not None)])
    dist.all_reduce(out)
    return (out[0] / out[1]).item()


def one_process_delink(world: int, before: int = 2, after: int = 2) -> P2RForCausalLM:
    """The one-process trainer's delink (carry_optimizer_state, scale) around the same steps, flush semantics, on
    batches of 2 * world blocks in `world` micro-batches."""
    model = model_of("cycle")
    optimizer = adamw(model.parameters())
    for step, ids in enumerate(batches(before + after, 2 * world)):
        if step == before:
            previous, mapping = ParameterSnapshot.of(model), model.delink_parameter_map()
            model.delink()
            new_optimizer = adamw(model.parameters())
            carry_optimizer_state(optimizer, new_optimizer, previous, ParameterSnapshot.of(model), mapping, "scale")
            optimizer = new_optimizer
        accumulate(model, ids, world)
        optimizer.step()
        optimizer.zero_grad()
    return model


def delink_checks(world: int, folder: str) -> dict:
    out = {}
    losses, pipeline, _ = run_with_delink("1f1b", world)
    reference = dict(one_process_delink(world).named_parameters())
    out["delink_vs_one_process"] = worst_difference(
        (param, reference[name]) for name, param in pipeline.named_parameters()
    )
    out["real_after_delink"] = not pipeline.config.share_layers and not pipeline.replicas
    for schedule in ("1f1b", "2bw"):
        uninterrupted = losses if schedule == "1f1b" else run_with_delink(schedule, world)[0]
        for stop in (2, 3):  # just before the delink, and after it
            head, saved = run_with_delink(schedule, world, stop=stop)
            resumed = run_with_delink(schedule, world, state=saved)[0]
            out[f"resume/{schedule}/{stop}"] = (head + resumed, uninterrupted)
    # The real model as one ordinary checkpoint.
    weights = gather_state_dict(pipeline)
    if dist.get_rank() == 0:
        config = pipeline_model_config(pipeline)
        with torch.device("meta"):
            skeleton = P2RForCausalLM(config)
        save_model(skeleton, folder, state_dict=weights, progress=False)
        loaded = P2RForCausalLM.from_pretrained(folder)
        out["saved_real"] = not loaded.config.share_layers and all(
            torch.equal(param, weights[name]) for name, param in loaded.named_parameters()
        )
    return out


def trainer_runs(folder: str) -> dict:
    """The trainer with pipeline_parallel_size 2 (2bw, tiny cycle model, delink at step 2): a full run, and a run
    resumed from the checkpoint after the delink; their losses, and what real/ loads as."""
    output_dir = f"{folder}/run"
    argv = tiny_argv(output_dir, **TRAINER)
    assert train(parse_config(argv)) == 0
    full = [
        (record["step"], record["loss"]) for record in read_metrics(f"{output_dir}/metrics.jsonl") if "loss" in record
    ]
    checkpoint = f"{output_dir}/checkpoints/checkpoint-3"
    assert train(parse_config([*argv, "--resume_from_checkpoint", checkpoint])) == 0
    resumed = [
        (record["step"], record["loss"]) for record in read_metrics(f"{output_dir}/metrics.jsonl") if "loss" in record
    ]
    real = P2RForCausalLM.from_pretrained(f"{output_dir}/real")
    return {"full": full, "resumed": resumed, "real_blocks": real.config.num_unique_layers}


def data_parallel_checks(world: int, folder: str) -> dict:
    """Two pipelines of two stages (2-D mesh), replicated and FSDP2-sharded stages, each pipeline on half the batch,
    against one process on the whole batch: weights after two 1F1B steps (real, cycle), 2BW's delayed update
    (replicated), the delink, and a checkpoint resumed before and after it (sharded: shards of weights and state)."""
    mesh = pipeline_mesh(pipeline_parallel_size=2, data_parallel_size=2)
    out = {}
    data = batches(2, 8)  # 2 pipelines x 2 micro-batches x 2 blocks
    for shard in (False, True):
        kind = "shard" if shard else "replicate"
        for pattern in ("real", "cycle"):
            pipeline = build_pipeline(
                model_of(pattern), schedule="1f1b", num_microbatches=2, seq_len=SEQ, mesh=mesh, shard=shard
            )
            optimizer = adamw(pipeline.parameters())
            reference = model_of(pattern)
            reference_optimizer = adamw(reference.parameters())
            for ids in data:
                pipeline.step(ids.chunk(2)[pipeline.data_rank])
                pipeline.clip_grad_norm_(1e9)  # the norm's reductions run; nothing is clipped
                optimizer.step()
                optimizer.zero_grad()
                accumulate(reference, ids, 4)
                reference_optimizer.step()
                reference_optimizer.zero_grad()
            weights = dict(reference.named_parameters())
            mine = pipeline.state_dict()  # whole weights: a collective over the column when sharded
            out[f"{kind}/{pattern}"] = worst_difference((mine[name], weights[name]) for name in mine)
        losses, pipeline, _ = run_with_delink("1f1b", 4, mesh=mesh, shard=shard)
        reference = dict(one_process_delink(4).named_parameters())
        mine = pipeline.state_dict()
        out[f"{kind}/delink"] = worst_difference((mine[name], reference[name]) for name in mine)
        # Sharded: every weight of the delinked stages is an FSDP2 DTensor holding half of its rows here.
        out[f"{kind}/halves"] = all(
            hasattr(param, "to_local") and 2 * param.to_local().shape[0] == param.shape[0]
            for param in pipeline.parameters()
        )
        before_delink = None
        for stop in (2, 3):
            head, (step, saved) = run_with_delink("1f1b", 4, stop=stop, mesh=mesh, shard=shard)
            path = f"{folder}/{kind}-{stop}-{dist.get_rank()}.pt"
            torch.save(saved, path)  # what the trainer writes, loaded as the trainer loads it
            resumed = run_with_delink(
                "1f1b", 4, state=(step, torch.load(path, weights_only=True)), mesh=mesh, shard=shard
            )[0]
            out[f"{kind}/resume/{stop}"] = (head + resumed, losses)
            before_delink = saved if stop == 2 else before_delink
        # A checkpoint of another layout (one pipeline, or the other kind of stages) is refused in one line.
        other = build_pipeline(
            model_of("cycle"), schedule="1f1b", num_microbatches=2, seq_len=SEQ, mesh=mesh, shard=not shard
        )
        try:
            load_pipeline_state(other, None, before_delink)  # the same split and blocks, the other stages
            out[f"{kind}/other_layout"] = None
        except ValueError as error:
            out[f"{kind}/other_layout"] = str(error)
    # 2BW with replicated data-parallel stages: W(t+1) = W(t) - AdamW(mean gradient over both pipelines at W(t-1)).
    pipeline = build_pipeline(
        model_of("cycle"), schedule="2bw", num_microbatches=2, seq_len=SEQ, optimizer_factory=adamw, mesh=mesh
    )
    for ids in batches(3, 8):
        pipeline.step(ids.chunk(2)[pipeline.data_rank])
    pipeline.drain()
    reference, _ = delayed_reference("cycle", batches(3, 8), 4)
    weights = dict(reference.named_parameters())
    out["replicate/2bw"] = worst_difference((param, weights[name]) for name, param in pipeline.named_parameters())
    return out


def losses_of(output_dir: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(f"{output_dir}/metrics.jsonl") if "loss" in r]


def trainer_with_resumes(output_dir: str, fields: dict, resume_from: tuple[int, ...]) -> dict:
    """A full trainer run of `fields`, then runs resumed from each checkpoint in `resume_from`: their losses, the
    number of blocks at each step, and what real/ loads as."""
    argv = tiny_argv(output_dir, **fields)
    assert train(parse_config(argv)) == 0
    out = {"argv": argv, "full": losses_of(output_dir)}
    out["blocks"] = [(r["step"], r["num_blocks"]) for r in read_metrics(f"{output_dir}/metrics.jsonl") if "loss" in r]
    for step in resume_from:
        assert (
            train(parse_config([*argv, "--resume_from_checkpoint", f"{output_dir}/checkpoints/checkpoint-{step}"])) == 0
        )
        out[f"resumed/{step}"] = losses_of(output_dir)
    out["real_blocks"] = P2RForCausalLM.from_pretrained(f"{output_dir}/real").config.num_unique_layers
    return out


def trainer_data_parallel(folder: str) -> dict:
    """The trainer with 2 pipelines x 2 stages of FSDP2-sharded stages, growing 1 -> 2 -> 4 blocks (GROWTH): a full
    run and runs resumed after each delink."""
    fields = {**GROWTH, "data_parallel_size": 2, "data_parallel_shard": "true"}
    return trainer_with_resumes(f"{folder}/dp-run", fields, resume_from=(2, 3))


def two_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return {
        "flush": flush_schedules(world),
        "replicas_equal": replicas_stay_equal(world),
        "2bw": pipedream_2bw(world),
        **delink_checks(world, folder),
        "trainer": trainer_runs(folder),
        "trainer_growth": trainer_with_resumes(f"{folder}/growth-run", GROWTH, resume_from=(2,)),
    }


def four_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return {
        "replicas_equal": replicas_stay_equal(world, "giant"),
        "2bw": pipedream_2bw(world, patterns=("giant",), steps=3),
        "data_parallel": data_parallel_checks(world, folder),
        "trainer_data_parallel": trainer_data_parallel(folder),
    }


two = spawn.shared_run(two_processes, 2)
four = spawn.shared_run(four_processes, 4)


def test_flush_schedules_equal_gradient_accumulation(two):
    assert len(two["flush"]) == 14
    for name, (grad_difference, loss_difference) in two["flush"].items():
        assert grad_difference < 1e-7, name
        assert loss_difference < 1e-6, name


def test_cycle_replicas_stay_bitwise_equal(two, four):
    assert two["replicas_equal"] and four["replicas_equal"]


def test_2bw_applies_the_delayed_update_with_two_versions(two, four):
    for result in (two["2bw"], four["2bw"]):
        for pattern, (weight_difference, loss_difference, versions) in result.items():
            assert weight_difference < (1e-7 if pattern == "real" else ATOL), pattern
            assert loss_difference < 1e-6, pattern
            assert versions == 2, pattern  # two versions are live in steady state, never more


def test_delink_in_a_pipeline_equals_the_one_process_delink(two):
    assert two["delink_vs_one_process"] < ATOL
    assert two["real_after_delink"]


@pytest.mark.parametrize("case", ["resume/1f1b/2", "resume/1f1b/3", "resume/2bw/2", "resume/2bw/3"])
def test_resume_gives_the_same_losses_before_and_after_the_delink(two, case):
    resumed, uninterrupted = two[case]
    assert resumed == uninterrupted


def test_the_real_output_loads_with_from_pretrained(two):
    assert two["saved_real"]


def test_balanced_split_counts_the_head_and_keeps_blocks_whole():
    small, big = tiny_config(vocab_size=64), tiny_config(vocab_size=32000)
    assert balanced_split(small, 2, SEQ) == [4, 4]
    heavy = balanced_split(big, 2, SEQ)
    assert heavy[1] < heavy[0]  # the head's vocabulary costs the last stage layers
    sequence = tiny_config(share_layers=True, num_unique_layers=2, sharing_pattern="sequence", vocab_size=32000)
    assert balanced_split(sequence, 2, SEQ) == [4, 4]  # one block per stage, whatever the head costs
    assert "automatic" in explain_split(big, heavy, SEQ, manual=False)


def test_the_split_costs_a_stage_by_the_models_inventory():
    """One count of a model's FLOPs and parameters: one stage holding the whole model costs what the inventory
    says (a shared block's parameters once, each depth's FLOPs)."""
    config = tiny_config(share_layers=True, num_unique_layers=2, vocab_size=32000)
    inv = inventory(config)
    assert stage_cost(inv, 0, config.num_hidden_layers, True, True, SEQ) == (
        inv.flops(SEQ),
        inv.numel * BYTES_PER_PARAMETER,
    )


def test_manual_split_is_checked():
    sequence = tiny_config(share_layers=True, num_unique_layers=2, sharing_pattern="sequence")
    with pytest.raises(ValueError, match=r"^pipeline_split: \[3, 5\] starts a stage inside a shared block"):
        check_split(sequence, [3, 5], 2)
    with pytest.raises(ValueError, match=r"^pipeline_split: \[4, 3\] must give 2 stages"):
        check_split(tiny_config(), [4, 3], 2)
    assert check_split(tiny_config(share_layers=True, num_unique_layers=2), [3, 5], 2) == [3, 5]  # cycle: any depth


def test_the_trainer_runs_a_pipeline_and_resumes_after_the_delink(two):
    run = two["trainer"]
    assert [step for step, _ in run["full"]] == [1, 2, 3, 4]
    assert run["resumed"] == run["full"]
    assert run["real_blocks"] == 4


def test_data_parallel_pipelines_equal_one_process_on_the_whole_batch(four):
    result = four["data_parallel"]
    for kind in ("replicate", "shard"):
        # Each pipeline's mean over its micro-batches, then the mean over the pipelines: the one-process mean in
        # another order, amplified by AdamW as for shared blocks (ATOL).
        assert result[f"{kind}/real"] < ATOL, kind
        assert result[f"{kind}/cycle"] < ATOL, kind
        assert result[f"{kind}/delink"] < ATOL, kind
        assert result[f"{kind}/halves"] == (kind == "shard")
        assert result[f"{kind}/other_layout"].startswith("resume_from_checkpoint: the checkpoint's pipeline")
        for stop in (2, 3):  # resumed just before the delink and after it
            resumed, uninterrupted = result[f"{kind}/resume/{stop}"]
            assert resumed == uninterrupted, (kind, stop)
    assert result["replicate/2bw"] < ATOL


def one_process_losses(argv: list[str], tmp_path, pipelines: int = 1) -> list[tuple[int, float]]:
    """The one-process trainer's losses for a pipelined run's arguments: its pipeline fields dropped, the batch of
    all its pipelines in one."""
    fields, index = {}, 0
    while index < len(argv):
        name, values = argv[index][2:], []
        index += 1
        while index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        fields[name] = values
    for name in PIPELINE_FIELDS:
        fields.pop(name, None)
    fields["per_device_batch_size"] = [str(int(fields["per_device_batch_size"][0]) * pipelines)]
    fields["output_dir"] = [str(tmp_path / "one-process")]
    assert train(parse_config([item for name, values in fields.items() for item in (f"--{name}", *values)])) == 0
    return losses_of(str(tmp_path / "one-process"))


def assert_same_losses(pipelined, one_process):
    assert [step for step, _ in pipelined] == [step for step, _ in one_process]
    for (step, loss), (_, expected) in zip(pipelined, one_process, strict=True):
        assert loss == pytest.approx(expected, abs=1e-5), step


def test_the_trainer_grows_a_pipelined_model_as_one_process_does(two, tmp_path):
    """Partial delinks (1 -> 2 -> 4) and shared_lr_scale: depth in a 1F1B pipeline give the one-process trainer's
    losses, and resuming after the partial delink repeats them."""
    run = two["trainer_growth"]
    assert run["blocks"] == [[1, 1], [2, 2], [3, 4], [4, 4]]  # step 1 on 1 block, step 2 on 2, then the real model
    assert_same_losses(run["full"], one_process_losses(run["argv"], tmp_path))
    assert run["resumed/2"] == run["full"]
    assert run["real_blocks"] == 4


def test_the_trainer_runs_data_parallel_sharded_pipelines_and_resumes(four, tmp_path):
    """Two pipelines of FSDP2-sharded stages, growing: the one-process trainer's losses on their joint batch, the
    same losses resumed after the partial and after the full delink."""
    run = four["trainer_data_parallel"]
    assert [step for step, _ in run["full"]] == [1, 2, 3, 4]
    assert_same_losses(run["full"], one_process_losses(run["argv"], tmp_path, pipelines=2))
    assert run["resumed/2"] == run["full"] and run["resumed/3"] == run["full"]
    assert run["real_blocks"] == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--offload", "0.5"], r"^offload: not supported with pipeline_parallel_size > 1"),
        (
            ["--data_parallel_size", "2", "--data_parallel_shard", "true", "--pipeline_schedule", "2bw"],
            r"^data_parallel_shard: not supported with pipeline_parallel_size > 1 \(PipeDream-2BW swaps",
        ),
        (["--data_parallel_shard", "true"], r"^data_parallel_shard: shards over data_parallel_size > 1"),
        (["--num_microbatches", "3"], r"^num_microbatches: 3 must divide per_device_batch_size"),
        (["--pipeline_schedule", "2bw", "--num_microbatches", "1"], r"^num_microbatches: PipeDream-2BW needs"),
    ],
)
def test_the_trainer_refuses_what_a_pipeline_does_not_support(tmp_path, extra, message):
    argv = tiny_argv(tmp_path, pipeline_parallel_size=2, shared_lr_scale="none")
    with pytest.raises(ValueError, match=message):
        parse_config([*argv, *extra])
