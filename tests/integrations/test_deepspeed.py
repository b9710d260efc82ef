"""P2RTrainer under DeepSpeed ZeRO-3 (`accelerate launch --config_file configs/accelerate/deepspeed_zero3_offload.yaml`,
one CPU process with `use_cpu` off, as tests/distributed/test_deepspeed_zero_init.py runs hf-p2r's own trainer:
Accelerate sets up no several DeepSpeed processes on CPU) against one plain process, and resumed from its real-stage
checkpoint. Skipped without deepspeed (`pip install hf-p2r[deepspeed]`); its first run compiles DeepSpeed's CPU ops
(minutes)."""

import json

import pytest

from ..training.helpers import REPO
from .helpers import deterministic, p2r_config, trainer_for
from .test_launch import FIELDS, launch

pytest.importorskip("deepspeed")

ZERO3 = ["--config_file", str(REPO / "configs/accelerate/deepspeed_zero3_offload.yaml")]
RESET = dict(optimizer_carry="reset")  # the one carry DeepSpeed takes: its flat partitions keep no per-parameter state


@pytest.mark.slow
def test_zero3_trains_as_one_plain_process_until_the_optimizer_restarts_and_resumes_bitwise(tmp_path):
    """The same losses and gradient norms, bitwise, through the pseudo stage and the first step after the first delink
    (a new engine, the new model partitioned straight from the old partitions): the delinked weights are the same.
    Then they part by design: DeepSpeed restarts the whole optimizer state at a delink, the plain run's reset keeps
    the state of the parameters outside the blocks. The ZeRO-3 run goes on through the delink to the real model, and
    resuming it from checkpoint-6 (the real model; DeepSpeed's own checkpoint) reproduces it bitwise."""
    plain = trainer_for(p2r_config(tmp_path / "plain", **FIELDS, **RESET))
    plain.train()
    zero3 = launch(tmp_path, "zero3", processes=1, fields=RESET, args={"use_cpu": False}, launcher=ZERO3)
    single, deep = deterministic(plain.state.log_history), deterministic(zero3)
    assert [r["step"] for r in deep if "loss" in r] == list(range(1, 8))
    assert [(r["step"], r["p2r/num_blocks"]) for r in deep if "p2r/delink" in r] == [(2, 2), (4, 4)]
    first_after_delink = [index for index, record in enumerate(single) if record["step"] == 3][0]
    assert deep[: first_after_delink + 1] == single[: first_after_delink + 1]
    assert deep[first_after_delink + 1]["loss"] != single[first_after_delink + 1]["loss"]  # the restart shows

    checkpoint = tmp_path / "zero3" / "checkpoint-6"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["P2RCallback"][
        "attributes"
    ] == {"num_blocks": 4}
    resumed = launch(
        tmp_path, "resumed", processes=1, resume=str(checkpoint), fields=RESET, args={"use_cpu": False}, launcher=ZERO3
    )
    assert deterministic(resumed) == deep


@pytest.mark.slow
def test_a_carry_other_than_reset_is_refused_under_deepspeed(tmp_path):
    with pytest.raises(AssertionError, match=r"carry: under DeepSpeed the optimizer state lives in flat ZeRO"):
        launch(tmp_path, "scale", processes=1, fields={"optimizer_carry": "scale"}, args={"use_cpu": False},
               launcher=ZERO3)  # fmt: skip
