"""examples/trainer_callback.py, as docs/trainer.md tells users to run it: pseudo -> delink -> real, a resume from a
checkpoint on either side of the delink to the real model (the same real model, byte for byte), and the dry run of
the real model's push."""

import filecmp
import shutil
import subprocess

import pytest

from ..training.helpers import PYTHON, REPO, subprocess_env

EXAMPLE = str(REPO / "examples/trainer_callback.py")
STEPS = 12  # delinks at 2 (1 -> 2 blocks) and 4 (-> the real model); a checkpoint every 2 steps, an evaluation every 4


def run_example(output_dir, *flags: str) -> str:
    command = [PYTHON, EXAMPLE, "--output_dir", str(output_dir), "--max_steps", str(STEPS), *flags]
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_example_trains_resumes_on_either_side_of_the_delink_and_dry_runs_the_push(tmp_path):
    output = run_example(tmp_path / "run", "--push_to", "me/p2r-demo")
    assert f"real model with 8 blocks saved in {tmp_path / 'run' / 'real'}" in output
    assert "Dry run: would create (if needed) the model repo me/p2r-demo" in output
    assert "model.safetensors" in output and "A *real* P2R model" in output  # the card, rendered for the real model
    assert "p2r/delink" in output  # Trainer's own log lines show the delinks
    for checkpoint, flag in ((STEPS // 6, "checkpoint"), (STEPS // 2, "latest")):  # pseudo (before both delinks), real
        resumed = tmp_path / f"from-{checkpoint}"
        shutil.copytree(tmp_path / "run" / f"checkpoint-{checkpoint}", resumed / f"checkpoint-{checkpoint}")
        where = str(resumed / f"checkpoint-{checkpoint}") if flag == "checkpoint" else "latest"
        run_example(resumed, "--resume_from_checkpoint", where)
        for name in ("model.safetensors", "config.json"):
            assert filecmp.cmp(tmp_path / "run" / "real" / name, resumed / "real" / name, shallow=False), (
                checkpoint,
                name,
            )
