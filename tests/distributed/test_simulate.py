"""The schedule simulator against closed forms: GPipe's and 1F1B's bubble (d - 1) / (m + d - 1), 1F1B's d - s
micro-batches in flight, 2BW's bubble-free steady state with two weight versions, and torch's own action lists."""

import subprocess
import sys

import pytest

from hf_p2r.distributed.simulate import (
    BACKWARD,
    FORWARD,
    UPDATE,
    Action,
    StageCost,
    flush_bubble,
    gpipe_actions,
    one_f_one_b_actions,
    simulate,
    simulate_schedule,
    two_bw_actions,
)

FORWARD_S, BACKWARD_S = 1.0, 2.0  # exact in binary: the closed forms hold to the last bit


def uniform(stages: int, **fields) -> list[StageCost]:
    return [StageCost(FORWARD_S, BACKWARD_S, **fields)] * stages


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(4, 4), (4, 12), (8, 8), (16, 48), (64, 64)])
def test_flush_schedules_take_m_plus_d_minus_1_slots(schedule, stages, microbatches):
    result = simulate_schedule(schedule, uniform(stages), microbatches)
    assert result.step_time == (microbatches + stages - 1) * (FORWARD_S + BACKWARD_S)
    assert result.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1), abs=1e-12)
    assert flush_bubble(stages, microbatches) == pytest.approx(result.bubble, abs=1e-12)


@pytest.mark.parametrize("stages,microbatches", [(4, 4), (4, 9), (8, 16), (32, 32)])
def test_2bw_has_no_bubble_in_steady_state(stages, microbatches):
    result = simulate_schedule("2bw", uniform(stages), microbatches, batches=5)
    assert result.step_time == microbatches * (FORWARD_S + BACKWARD_S)
    assert result.bubble == 0
    flushed = simulate_schedule("1f1b", uniform(stages), microbatches)
    assert flushed.step_time - result.step_time == (stages - 1) * (FORWARD_S + BACKWARD_S)


def test_memory_follows_the_schedule():
    stages, microbatches, weights, activations = 4, 8, 1000, 10
    costs = uniform(stages, weights=weights, activations=activations)
    gpipe, flush, two_bw = (simulate_schedule(s, costs, microbatches) for s in ("gpipe", "1f1b", "2bw"))
    assert gpipe.peak_in_flight == [microbatches] * stages  # GPipe holds every micro-batch
    assert flush.peak_in_flight == two_bw.peak_in_flight == [stages - s for s in range(stages)]  # 1F1B: d - s <= d
    assert gpipe.peak_versions == flush.peak_versions == [1] * stages
    assert two_bw.peak_versions == [2] * stages
    assert flush.peak_bytes == [weights + (stages - s) * activations for s in range(stages)]
    assert two_bw.peak_bytes == [2 * weights + (stages - s) * activations for s in range(stages)]
    assert gpipe.peak_bytes == [weights + microbatches * activations] * stages


def test_an_update_before_the_batch_drains_shows_a_third_version():
    """The version count is read from the actions, not assumed: batch 1 runs with version 0 (as batch 0 does), batch
    2 with version 1; a stage that applies batch 1's update (version 2) before batch 1's last backward still owes a
    backward on version 0 while holding versions 1 and 2."""
    actions = two_bw_actions(2, 2, batches=4)
    stage0 = actions[0]
    update = stage0.index(Action(UPDATE, 0, 1))
    assert stage0[update - 1] == Action(BACKWARD, 0, 3)
    stage0.insert(update - 1, stage0.pop(update))  # U1 before B3
    result = simulate(actions, uniform(2), 2)
    assert result.peak_versions[0] == 3


def test_2bw_refuses_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match=r"num_microbatches \(3\) must be at least the pipeline depth \(4\)"):
        two_bw_actions(4, 3, batches=3)


def test_communication_latency_costs_1f1b_a_round_trip_per_d_microbatches():
    """With p2p latency l, the critical loop F(i) -> last stage -> B(i) on stage 0 holds d micro-batches and takes
    d (f + b) + 2 (d - 1) l, so 2BW's steady state spends 2 (d - 1) l / d per micro-batch waiting."""
    stages, microbatches, latency = 4, 8, 0.25
    result = simulate_schedule("2bw", uniform(stages), microbatches, p2p=latency)
    per_microbatch = (stages * (FORWARD_S + BACKWARD_S) + 2 * (stages - 1) * latency) / stages
    assert result.step_time == pytest.approx(microbatches * per_microbatch)
    gpipe = simulate_schedule("gpipe", uniform(stages), microbatches, p2p=latency)
    assert gpipe.step_time == pytest.approx((microbatches + stages - 1) * 3.0 + 2 * (stages - 1) * latency)


def test_the_slowest_stage_sets_the_pace():
    costs = [StageCost(1.0, 2.0), StageCost(2.0, 4.0), StageCost(1.0, 2.0)]
    result = simulate_schedule("2bw", costs, 6, batches=6)
    assert result.step_time == pytest.approx(6 * 6.0)
    assert result.bubble == pytest.approx(0)  # the busiest stage never waits in steady state
    assert result.idle == pytest.approx(1 - (3 + 6 + 3) / (3 * 6.0))  # the others wait for it
    flushed = simulate_schedule("1f1b", costs, 6)
    assert flushed.bubble > 0 and flushed.idle > flushed.bubble


def test_a_deadlocked_schedule_is_named():
    actions = gpipe_actions(2, 2)
    actions[1] = [Action(BACKWARD, 1, 0), Action(FORWARD, 1, 0)]  # backward before its forward
    actions[1] += [Action(FORWARD, 1, 1), Action(BACKWARD, 1, 1)]
    with pytest.raises(ValueError, match="the schedule deadlocks: every rank waits"):
        simulate(actions, uniform(2), 2)


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (3, 5), (4, 8)])
def test_action_lists_are_torchs(stages, microbatches):
    """GPipe and 1F1B are torch's `ScheduleGPipe` and `Schedule1F1B` (their `pipeline_order`). torch 2.13's 1F1B IR
    starts its last rank at F1 and ends at F{m} (its `_get_pipeline_order` counts the warmup from 0 where the last
    rank has none); `Schedule1F1B._step_microbatches` runs F0, B0, F1, B1, ..., which is ours."""
    compat = pytest.importorskip("hf_p2r.compat")
    pytest.importorskip("torch.distributed.pipelining")
    assert compat.pipeline_order("GPipe", stages, microbatches) == gpipe_actions(stages, microbatches)
    torchs, ours = compat.pipeline_order("1F1B", stages, microbatches), one_f_one_b_actions(stages, microbatches)
    assert torchs[:-1] == ours[:-1]
    assert ours[-1] == [Action(k, stages - 1, i) for i in range(microbatches) for k in (FORWARD, BACKWARD)]
    # 2BW over one batch is 1F1B with its flush.
    two_bw = two_bw_actions(stages, microbatches, batches=1)
    assert two_bw == ours


def test_torchs_interleaved_schedule_runs_in_the_simulator():
    """Multi-stage schedules are simulated from torch's lists as they are: 2 ranks x 2 virtual stages."""
    compat = pytest.importorskip("hf_p2r.compat")
    pytest.importorskip("torch.distributed.pipelining")
    actions = [[Action(*a) for a in rank] for rank in compat.pipeline_order("Interleaved1F1B", 2, 4)]
    result = simulate(actions, [StageCost(0.5, 1.0)] * 4, 4)
    busy = 4 * 2 * 1.5  # per rank: 4 micro-batches x 2 stages x (f + b)
    assert busy < result.step_time < busy + 3.0  # some bubble, less than the one-stage-per-rank 1F1B's (d - 1)(f + b)


def test_latency_per_boundary():
    """A slow link between two nodes delays only the sends that cross it."""
    costs = uniform(4)
    one_slow = simulate_schedule("gpipe", costs, 4, p2p=[0.0, 1.0, 0.0])
    assert one_slow.step_time == simulate_schedule("gpipe", costs, 4).step_time + 2 * 1.0
    with pytest.raises(ValueError, match=r"one latency per stage boundary \(3\), got 2"):
        simulate_schedule("gpipe", costs, 4, p2p=[0.0, 1.0])


def test_the_simulator_imports_no_torch():
    """simulate.py and the schedule registry it reads are pure Python: imported through the `hf_p2r.distributed`
    package (whose FSDP2 and pipeline runtime modules load on first use), they leave torch unimported."""
    code = (
        "import sys\n"
        "from hf_p2r.distributed import simulate as module\n"
        "module.simulate_schedule('2bw', [module.StageCost(1.0, 2.0)] * 4, 4)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_schedule_registry_and_the_pipeline_split_import_no_torch():
    """The planner sizes the split the trainer runs, for every schedule, from these two modules: plain Python (the
    model's inventory gives the split its costs), without the runtime's torch."""
    code = (
        "import sys\n"
        "from hf_p2r.distributed.pipeline import schedules, split\n"
        "print(schedules.get_schedule('2bw').versions(4), 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["2", "False"]
