"""P2RTrainer against hf-p2r's own trainer (`hf_p2r.training.train`, what `hf-p2r train` runs): the same model and
initial weights, the same blocks in the same order, AdamW (fused) with the same settings and weight-decay groups
(matrices and embeddings; transformers' name rules pick the same ones for a P2R model), clipping at 1.0, the same
delinks, carry and learning-rate rule.

Measured on this machine: every logged training loss, gradient norm and learning rate is equal bitwise, with
gradient accumulation too (equal micro-batches: transformers' token-count normalisation and Accelerate's mean give
the same numbers here). The test asserts equality; a change that makes them differ by rounding only would show as a
tiny relative difference in its message. The schedule is transformers' and hf-p2r's `constant` without warm-up:
their warm-up and decay formulas differ (docs/trainer.md), and `shared_lr_scale: none` (P2RTrainer gives a shared
block the same rate as the rest).
"""

import pytest

from hf_p2r.training import train

from ..training.helpers import trajectory
from .helpers import p2r_config, trainer_for

CASES = {
    "scale-continue": dict(optimizer_carry="scale", lr_after_delink="continue"),
    "copy-rewarm-accumulate": dict(
        optimizer_carry="copy", lr_after_delink="rewarm", gradient_accumulation_steps=2, per_device_batch_size=2
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_p2r_trainer_matches_hf_p2rs_own_trainer(tmp_path, case):
    fields = dict(pseudo_steps=6, real_steps=4, partial_delink_blocks=[2], rewarm_steps=3, **CASES[case])
    assert train(p2r_config(tmp_path / "own", **fields)) == 0
    trainer = trainer_for(p2r_config(tmp_path / "trainer", **fields))
    trainer.train()
    own = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in trajectory(tmp_path / "own") if "loss" in r]
    theirs = [
        (r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in trainer.state.log_history if "loss" in r
    ]
    assert len(own) == 10 and [step for step, *_ in theirs] == list(range(1, 11))
    worst = max(abs(a[1] - b[1]) / a[1] for a, b in zip(own, theirs))
    assert theirs == own, f"largest relative loss difference {worst:.2e}"
    delinks = [(r["step"], r["num_blocks"]) for r in trajectory(tmp_path / "own") if r.get("event") == "delink"]
    assert delinks == [(3, 2), (6, 4)]
    assert [(r["step"], r["p2r/num_blocks"]) for r in trainer.state.log_history if "p2r/delink" in r] == delinks
