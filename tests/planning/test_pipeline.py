"""Pipeline layouts in the planner: memory per stage by schedule against the schedule simulator's in-flight counts,
the bubble against (d - 1) / (m + d - 1), stage times against the planner's own step time, and the trainer fields it
prints."""

import dataclasses
import re
from fractions import Fraction

import pytest

from hf_p2r.distributed.pipeline.schedules import SCHEDULES, get_schedule
from hf_p2r.distributed.simulate import StageCost, simulate_schedule
from hf_p2r.planning import PRECISIONS, Hardware, Layout, Workload, estimate, parameter_tensors, plan
from hf_p2r.planning.memory import (
    head_activation_bytes,
    layer_activation_bytes,
    logits_bytes,
    model_state_bytes,
    pipeline_stages,
    stage_tensors,
)
from hf_p2r.planning.plan import stage_seconds

from ..conftest import tiny_config

STAGES, MICROBATCHES, MICRO_BATCH, SEQ = 4, 8, 2, 32


def workload(microbatches: int = MICROBATCHES, dp: int = 1) -> Workload:
    return Workload(SEQ, MICRO_BATCH, microbatches * MICRO_BATCH * dp, PRECISIONS["mixed"])


def stage_activations(config, precision) -> list[int]:
    """Bytes one micro-batch leaves saved on each of the `STAGES` stages (layers, input ids on the first, head and
    logits on the last), from the per-layer counts tests/planning/test_memory.py checks against autograd."""
    tokens = MICRO_BATCH * SEQ
    per_layer = layer_activation_bytes(config, tokens, 1, precision)
    per_stage = config.num_hidden_layers // STAGES
    head = head_activation_bytes(config, tokens, precision) + logits_bytes(config, tokens, precision)
    return [
        per_stage * per_layer + (8 * tokens if s == 0 else 0) + (head if s == STAGES - 1 else 0) for s in range(STAGES)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_stage_memory_follows_the_schedule(schedule):
    """The planner's most loaded stage = the simulator's peak in-flight micro-batches x bytes per micro-batch, plus
    the weight versions the simulator counts."""
    config, precision = tiny_config(), PRECISIONS["mixed"]
    tensors = parameter_tensors(config)
    weights = [
        model_state_bytes(stage_tensors(tensors, stage, False), Layout(dp=1), precision).weights
        for stage in pipeline_stages(config, STAGES)
    ]
    per_microbatch = stage_activations(config, precision)
    costs = [StageCost(1.0, 2.0, weights=w, activations=a) for w, a in zip(weights, per_microbatch)]
    simulated = simulate_schedule(schedule, costs, MICROBATCHES)
    expected = {"gpipe": [MICROBATCHES] * STAGES, "1f1b": [4, 3, 2, 1], "2bw": [4, 3, 2, 1]}[schedule]
    assert simulated.peak_in_flight == expected

    planned = estimate(config, Layout(dp=1, pp=STAGES, schedule=schedule), workload(), Hardware(), tensors)
    activations = [n * a for n, a in zip(simulated.peak_in_flight, per_microbatch)]
    loaded = max(range(STAGES), key=lambda s: planned_total(config, tensors, schedule, s, activations[s]))
    assert planned.memory.activations == activations[loaded]
    assert planned.memory.weights == simulated.peak_versions[loaded] * weights[loaded]


def planned_total(config, tensors, schedule, stage, activations) -> int:
    """Model states and activations of one stage: the planner reports the most loaded stage, this finds which."""
    held = stage_tensors(tensors, pipeline_stages(config, STAGES)[stage], False)
    states = model_state_bytes(held, Layout(dp=1), PRECISIONS["mixed"])
    return states.model_states + (states.weights if schedule == "2bw" else 0) + activations


def test_2bw_keeps_two_weight_versions_and_1f1bs_activations():
    config, tensors = tiny_config(), parameter_tensors(tiny_config())
    flush, two_bw = (
        estimate(config, Layout(dp=1, pp=STAGES, schedule=s), workload(), Hardware(), tensors).memory
        for s in ("1f1b", "2bw")
    )
    assert two_bw.weights == 2 * flush.weights
    assert (two_bw.grads, two_bw.optimizer, two_bw.activations) == (flush.grads, flush.optimizer, flush.activations)


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 8), (8, 8), (8, 24)])
def test_bubble_and_step_time_follow_the_schedule(stages, microbatches):
    config = tiny_config(num_hidden_layers=8 * 2)
    by_schedule = {
        s: estimate(config, Layout(dp=1, pp=stages, schedule=s), workload(microbatches), Hardware())
        for s in ("gpipe", "1f1b", "2bw")
    }
    flush = Fraction(stages - 1, microbatches + stages - 1)
    assert by_schedule["gpipe"].bubble == by_schedule["1f1b"].bubble == pytest.approx(float(flush), abs=1e-15)
    assert by_schedule["2bw"].bubble == 0
    ratio = by_schedule["1f1b"].compute_seconds / by_schedule["2bw"].compute_seconds
    assert ratio == pytest.approx(float(Fraction(microbatches + stages - 1, microbatches)))
    # The simulator, fed the planner's stage times, agrees on equal stages (no head: tie the pace to the blocks).
    times = stage_seconds(
        config, parameter_tensors(config), Layout(dp=1, pp=stages), workload(microbatches), Hardware()
    )
    middle = times["stages"][0]
    simulated = simulate_schedule("1f1b", [StageCost(*middle)] * stages, microbatches)
    assert simulated.bubble == pytest.approx(float(flush))


def test_stage_seconds_add_up_to_the_planners_compute_time():
    config, hardware = tiny_config(), Hardware(gpus_per_node=2)
    layout = Layout(dp=1, pp=STAGES, schedule="2bw")
    times = stage_seconds(config, parameter_tensors(config), layout, workload(), hardware)
    planned = estimate(config, layout, workload(), hardware)
    busy = sum(f + b for f, b in times["stages"]) * MICROBATCHES
    assert busy / STAGES == pytest.approx(planned.compute_seconds)
    activations = MICRO_BATCH * SEQ * config.hidden_size * PRECISIONS["mixed"].activation
    intra, inter = activations / hardware.intra_node_bandwidth, activations / hardware.inter_node_bandwidth
    assert times["p2p"] == pytest.approx([intra, inter, intra])  # 2 GPUs per node: stages 1 | 2 cross nodes


def test_schedules_that_need_m_at_least_d_are_not_offered_below():
    """Every schedule the trainer runs is sized (the registry's), those that need m >= d only with m >= d."""
    config, hardware = tiny_config(), Hardware(gpus_per_node=4)
    few = [e.layout for e in plan(config, 4, workload(microbatches=2), hardware, max_pp=4) if e.layout.pp == 4]
    any_m = {name for name in SCHEDULES if not get_schedule(name).microbatches_at_least_stages}
    assert {layout.schedule for layout in few} == any_m == {"gpipe", "interleaved_1f1b", "zero_bubble"}
    enough = [e.layout for e in plan(config, 4, workload(microbatches=4), hardware, max_pp=4) if e.layout.pp == 4]
    assert {layout.schedule for layout in enough} == set(SCHEDULES)
    assert all(layout.tp == 1 and layout.offload == 0 for layout in enough)


def test_pipeline_layouts_name_the_trainer_fields_that_run_them():
    config, hardware = tiny_config(), Hardware(gpus_per_node=8)
    estimates = [e for e in plan(config, 8, workload(dp=2), hardware, max_pp=4) if e.layout.pp > 1]
    assert {e.layout.dp for e in estimates} == {2, 4}
    for e in estimates:
        fields = dict(re.findall(r"(\w+): (\w+)", e.engine))
        assert fields["pipeline_parallel_size"] == str(e.layout.pp)
        assert fields["pipeline_schedule"] == e.layout.schedule
        assert fields["num_microbatches"] == str(e.microbatches)
        assert fields["per_device_batch_size"] == str(e.microbatches * MICRO_BATCH)
        assert fields["data_parallel_size"] == str(e.layout.dp)
        assert fields.get("activation_checkpointing") == ("true" if e.layout.recompute else None)
        sharded = e.layout.zero == 3  # FSDP2 in each stage over the data-parallel pipelines
        assert fields.get("data_parallel_shard") == ("true" if sharded else None)
        # The trainer refuses mixed precision in a pipeline so far, and sharded stages under 2BW: sized, not run.
        refused = "FSDP2-sharded stages under PipeDream-2BW and " if sharded and e.layout.schedule == "2bw" else ""
        assert e.engine.endswith(f"sizing only: the trainer refuses {refused}mixed precision (stages run in fp32) yet")


def fp32_pipeline_engine(schedule: str = "2bw", recompute: bool = True, dp: int = 1, zero: int = 0) -> str:
    fp32 = dataclasses.replace(workload(), precision=PRECISIONS["fp32"])
    layout = Layout(dp=dp, pp=STAGES, zero=zero, schedule=schedule, recompute=recompute)
    return estimate(tiny_config(), layout, fp32, Hardware()).engine


def test_a_one_pipeline_fp32_layout_is_run_not_sized():
    engine = fp32_pipeline_engine()
    assert "sizing only" not in engine and "data_parallel_size" not in engine
    assert engine == (
        "pipeline_parallel_size: 4, pipeline_schedule: 2bw, num_microbatches: 8, per_device_batch_size: 16, "
        "gradient_accumulation_steps: 1, pipeline_split: [2,2,2,2], activation_checkpointing: true, "
        'mixed_precision: "no"'
    )


@pytest.mark.parametrize(
    ("schedule", "dp", "zero"), [("gpipe", 1, 0), ("1f1b", 1, 0), ("2bw", 1, 0), ("2bw", 2, 0), ("1f1b", 2, 3)]
)
def test_the_trainer_accepts_what_plan_prints(tmp_path, schedule, dp, zero):
    """The fields a runnable pipeline layout prints (one pipeline, data-parallel replicas, FSDP2-sharded stages),
    added to a trainer YAML, pass the trainer's own checks."""
    from hf_p2r.training.config import parse_config

    engine = fp32_pipeline_engine(schedule, dp=dp, zero=zero)
    assert "sizing only" not in engine
    printed = engine.split(", ")  # each "name: value" as printed, one YAML line each
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "hidden_size: 32\nintermediate_size: 64\nnum_hidden_layers: 8\nnum_attention_heads: 4\n"
        + "".join(f"{line}\n" for line in printed)
    )
    try:
        run = parse_config(["--config", str(yaml_file)])
    except ValueError as error:
        if "pipeline_parallel_size" in str(error) and "unrecognized" in str(error):
            pytest.skip("the trainer has no pipeline fields yet")
        raise
    assert (run.train.pipeline_parallel_size, run.train.pipeline_schedule) == (STAGES, schedule)
    microbatches = MICROBATCHES // dp  # the batch is split over the data-parallel pipelines
    assert (run.train.num_microbatches, run.train.per_device_batch_size) == (microbatches, microbatches * MICRO_BATCH)
    assert run.train.pipeline_split == [2, 2, 2, 2]  # the trainer's balanced split, which the planner sized
    assert run.train.gradient_accumulation_steps == 1
    assert run.model.activation_checkpointing and run.train.mixed_precision == "no"
    assert (run.train.data_parallel_size, run.train.data_parallel_shard) == (dp, zero == 3)


@pytest.mark.parametrize("blocks,splittable", [(4, True), (2, False), (3, False), (None, True)])
def test_a_sequence_pseudo_model_is_not_cut_inside_a_block(blocks, splittable):
    """8 depths in 4 stages: the trainer never starts a stage inside a `sequence` block, so neither does the planner.
    4 blocks of 2 depths: one block per stage; 2 blocks of 4, or 3 of 3, 3 and 2: fewer blocks than stages, no split
    (the trainer refuses it, the planner leaves it out); a real model (None): any cut."""
    shared = {"share_layers": True, "num_unique_layers": blocks, "sharing_pattern": "sequence"} if blocks else {}
    config = tiny_config(**shared)
    fp32 = dataclasses.replace(workload(), precision=PRECISIONS["fp32"])
    layout = Layout(dp=1, pp=STAGES, schedule="1f1b")
    from hf_p2r.distributed.pipeline import check_split

    if splittable:
        engine = estimate(config, layout, fp32, Hardware()).engine
        assert "sizing only" not in engine and "pipeline_split: [2,2,2,2]" in engine
        check_split(config, [2, 2, 2, 2], STAGES)
    else:
        with pytest.raises(ValueError, match="4 stages need at least as many blocks"):
            estimate(config, layout, fp32, Hardware())
        assert not [e for e in plan(config, 4, workload(), Hardware(), max_pp=4) if e.layout.pp == STAGES]
        with pytest.raises(ValueError, match="starts a stage inside a shared block"):
            check_split(config, [2, 2, 2, 2], STAGES)


# Models whose balanced split is not always the equal one: a heavy head (large vocabulary), a sequence pseudo model
# (cut between blocks only) with a heavy head, a tied head; each under every schedule (interleaved ones: two stages
# per process).
SPLIT_MODELS = {
    "heavy head": dict(vocab_size=2000),
    "sequence, 4 blocks": dict(share_layers=True, num_unique_layers=4, sharing_pattern="sequence", vocab_size=1500),
    "cycle, tied": dict(share_layers=True, num_unique_layers=2, tie_word_embeddings=True, num_hidden_layers=6),
}


def trainer_stages(rank: int, world: int) -> dict:
    """Each process's depths in the trainer's pipeline (`build_pipeline`, automatic split) for every model and
    schedule, gathered on rank 0."""
    import torch
    import torch.distributed as dist

    from hf_p2r import P2RForCausalLM
    from hf_p2r.distributed.pipeline import build_pipeline

    out = {}
    for name, fields in SPLIT_MODELS.items():
        for schedule in SCHEDULES:
            torch.manual_seed(0)
            model = P2RForCausalLM(tiny_config(**fields))
            pipeline = build_pipeline(
                model,
                schedule=schedule,
                num_microbatches=2,
                seq_len=SEQ,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
            )
            depths = [list(module.depths) for module in pipeline.modules]
            gathered = [None] * world
            dist.all_gather_object(gathered, depths)
            out[f"{name}/{schedule}"] = {"split": list(pipeline.split), "depths": gathered}
    return out


def test_the_planner_sizes_the_split_the_trainer_runs(tmp_path):
    """For every schedule, the planner's processes run the depths the trainer's pipeline gives them."""
    from ..distributed import spawn

    built = spawn.run(trainer_stages, 2, tmp_path)
    for name, fields in SPLIT_MODELS.items():
        config = tiny_config(**fields)
        for schedule in SCHEDULES:
            planned = pipeline_stages(config, 2, SEQ, schedule)
            trainer = built[f"{name}/{schedule}"]
            assert [[list(depths) for _, depths in stage.parts] for stage in planned] == trainer["depths"], (
                name,
                schedule,
            )
            split = [len(depths) for _, depths in sorted(part for stage in planned for part in stage.parts)]
            assert split == trainer["split"]
    uneven = {key: value["split"] for key, value in built.items() if len(set(value["split"])) > 1}
    assert uneven, "some split is not the equal one"
