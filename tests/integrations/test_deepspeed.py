"""P2RTrainer under DeepSpeed ZeRO-3 (`accelerate launch --config_file configs/accelerate/deepspeed_zero3_offload.yaml`,
one CPU process with `use_cpu` off, as tests/distributed/test_deepspeed_zero_init.py runs hf-p2r's own trainer:
Accelerate sets up no several DeepSpeed processes on CPU) against one plain process, and resumed from its real-stage
checkpoint. Skipped without deepspeed (`pip install hf-p2r[deepspeed]`); its first run compiles DeepSpeed's CPU ops
(minutes)."""

import functools
import json

import pytest

from hf_p2r.integrations import P2RCallback

from ..distributed import spawn
from ..distributed.test_accelerate_configs import use_launch_env
from ..training.helpers import REPO
from .helpers import deterministic, p2r_config, trainer_for
from .test_launch import FIELDS, launch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.usefixtures("deepspeed_offload_ops")  # built once, before the first launch (conftest)

ZERO3 = ["--config_file", str(REPO / "configs/accelerate/deepspeed_zero3_offload.yaml")]
# The first ZeRO-3 offload run builds DeepSpeed's CPU Adam (Accelerate puts it in place of AdamW): 10+ minutes on a
# loaded two-core machine.
FIRST_BUILD = 2400
RESET = dict(optimizer_carry="reset")  # the one carry DeepSpeed takes: its flat partitions keep no per-parameter state


@pytest.mark.slow
def test_zero3_trains_as_one_plain_process_until_the_optimizer_restarts_and_resumes_bitwise(tmp_path):
    """The same losses and gradient norms within 1e-5 relative (DeepSpeed sums the gradient norm over its fp32
    partitions in another order: 1.4240397 against 1.4240400 at step 1, measured; clipping then scales the update by a
    last-digit different factor) through the pseudo stage and the first step after the first delink (a new engine,
    the new model partitioned straight from the old partitions), so the delinked weights are the same. Then they part
    by design: DeepSpeed restarts the whole optimizer state at a delink, the plain run's reset keeps the state of the
    parameters outside the blocks (step 4's loss differs by far more). The ZeRO-3 run goes on through the delink to
    the real model, and resuming it from checkpoint-6 (the real model; DeepSpeed's own checkpoint) in a fresh process
    with the launcher's environment reproduces it bitwise."""
    plain = trainer_for(p2r_config(tmp_path / "plain", **FIELDS, **RESET))
    plain.train()
    zero3 = launch(tmp_path, "zero3", 1, fields=RESET, args={"use_cpu": False}, launcher=ZERO3, timeout=FIRST_BUILD)
    single, deep = deterministic(plain.state.log_history), deterministic(zero3)
    assert [r["step"] for r in deep if "loss" in r] == list(range(1, 8))
    assert [(r["step"], r["p2r/num_blocks"]) for r in deep if "p2r/delink" in r] == [(2, 2), (4, 4)]
    losses = {r["step"]: (r["loss"], s["loss"]) for r, s in zip(deep, single) if "loss" in r}
    norms = {r["step"]: (r["grad_norm"], s["grad_norm"]) for r, s in zip(deep, single) if "loss" in r}
    for step in (1, 2, 3):  # the pseudo stage, and the first step after the delink at 2
        assert losses[step][0] == pytest.approx(losses[step][1], rel=1e-5), step
        assert norms[step][0] == pytest.approx(norms[step][1], rel=1e-5), step
    assert abs(losses[4][0] - losses[4][1]) > 1e-4 * losses[4][1]  # the restarted optimizer shows

    checkpoint = tmp_path / "zero3" / "checkpoint-6"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["P2RCallback"][
        "attributes"
    ] == {"num_hidden_layers": 4, "num_blocks": 4}
    resume = functools.partial(resumes, str(tmp_path / "resumed"), str(checkpoint))
    assert deterministic(spawn.run(resume, 1, tmp_path)["history"]) == deep


def zero3_environment() -> None:
    """What `accelerate launch --config_file configs/accelerate/deepspeed_zero3_offload.yaml` puts in the environment of
    its one process."""
    use_launch_env("deepspeed_zero3_offload")


def scale_is_refused(folder: str, rank: int, world_size: int) -> dict:
    """What a ZeRO-3 run with carry "scale" raises as it starts (None: nothing)."""
    zero3_environment()
    trainer = trainer_for(p2r_config(folder, **{**FIELDS, "optimizer_carry": "scale"}), use_cpu=False)
    try:
        trainer.train()
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def resumes(folder: str, checkpoint: str, rank: int, world_size: int) -> dict:
    """The ZeRO-3 run of FIELDS resumed from `checkpoint`; its log history."""
    zero3_environment()
    trainer = trainer_for(p2r_config(folder, **FIELDS, **RESET), use_cpu=False, save_strategy="steps", save_steps=2)
    trainer.train(resume_from_checkpoint=checkpoint)
    return {"history": trainer.state.log_history}


def grows(folder: str, rank: int, world_size: int) -> dict:
    """A run of GROWTH_FIELDS growing by GROWTH under ZeRO-3; its log history."""
    zero3_environment()
    callback = P2RCallback(**GROWTH["callback"])
    config = p2r_config(folder, **{**FIELDS, **GROWTH_FIELDS})
    trainer = trainer_for(config, callback=callback, real_depth=GROWTH["real_depth"], use_cpu=False,
                          save_strategy="steps", save_steps=2)  # fmt: skip
    trainer.train()
    return {"history": trainer.state.log_history}


# The launcher itself is tested above (the ZeRO-3 run under `accelerate launch`); its resume, the refusal and the growth
# run in a spawned process with the launcher's environment (the launcher's start-up and a fresh interpreter's imports
# cost more than any of these runs).
@pytest.mark.slow
def test_a_carry_other_than_reset_is_refused_under_deepspeed(tmp_path):
    refused = spawn.run(functools.partial(scale_is_refused, str(tmp_path / "scale")), 1, tmp_path)["refused"]
    assert refused is not None and refused.startswith("carry: under DeepSpeed the optimizer state lives in flat ZeRO")


# A shallow model (2 layers sharing 1 block) grown to 4 layers at step 2.
GROWTH_FIELDS = dict(num_hidden_layers=2, pseudo_steps=4, real_steps=0, partial_delink_blocks=[],
                     partial_delink_steps=[], **RESET)  # fmt: skip
GROWTH = {"callback": {"growth": [[2, 4]], "carry": "reset"}, "real_depth": 4}


@pytest.mark.slow
def test_depth_growth_runs_under_deepspeed_zero3(tmp_path):
    """A schedule that grows a 2-layer model to 4 layers under ZeRO-3 (`delink_in_training` -> `delink_deepspeed`: the
    grown model partitioned straight from the old partitions; the optimizer restarts, `carry: reset`) trains on to
    the end, logs the growth, and its last checkpoint holds the grown stage."""
    history = spawn.run(functools.partial(grows, str(tmp_path / "grow")), 1, tmp_path)["history"]
    assert [(r["step"], r["p2r/num_hidden_layers"]) for r in history if "p2r/grow" in r] == [(2, 4)]
    losses = [r["loss"] for r in history if "loss" in r]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
    state = json.loads((tmp_path / "grow" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["P2RCallback"]["attributes"]["num_hidden_layers"] == 4
