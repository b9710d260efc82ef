"""The pipelined trainer (two processes, one stage each) keeps the one-process trainer's promises: nothing under
output_dir changes until a resume has loaded; a damaged stage file, a stage file that does not fit or a schedule that
ends before the checkpoint is one line on every process; a checkpoint is never written with non-finite weights (one
process's NaN stops both); the run ends with the summary, printed once."""

import contextlib
import functools
import io
import shutil

import pytest
import torch
import torch.distributed as dist

from hf_p2r.training import NonFiniteLossError, parse_config, train

from ..distributed import spawn
from .helpers import TWO_STAGES, tiny_argv
from .test_resume import snapshot, truncate

SCHEDULE = dict(
    TWO_STAGES,
    pseudo_steps=2,
    real_steps=2,
    save_steps=1,
    eval_steps=0,
    checkpoint_format="accelerate",  # the stage files damaged below (dcp: the default of several processes)
)


def _attempt(run) -> str:
    """The error's type and message, or "ok"."""
    try:
        run()
    except (ValueError, NonFiniteLossError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def _resume(output_dir: str, checkpoint: str, **overrides) -> str:
    argv = tiny_argv(output_dir, **{**SCHEDULE, **overrides}, resume_from_checkpoint=f"{output_dir}/{checkpoint}")
    return _attempt(lambda: train(parse_config(argv)))


def _on_rank0(action) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _body(folder: str, rank: int, world: int) -> dict:
    from pathlib import Path

    root = Path(folder)
    output_dir = root / "run"
    out = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train(parse_config(tiny_argv(output_dir, **SCHEDULE))) == 0
    out["summary"] = printed.getvalue()

    def case(name: str, damage, checkpoint: str, **overrides) -> None:
        copy = root / name
        _on_rank0(lambda: shutil.copytree(output_dir, copy))
        _on_rank0(lambda: damage(copy))
        before = snapshot(copy) if rank == 0 else None
        out[name] = _resume(str(copy), checkpoint, **overrides)
        dist.barrier()
        if rank == 0:
            out[f"{name}/unchanged"] = snapshot(copy) == before

    case("short", lambda copy: None, "checkpoints/checkpoint-4", real_steps=1)
    case("truncated", lambda copy: truncate(copy / "checkpoints/checkpoint-3/stage-1.pt"), "checkpoints/checkpoint-3")
    foreign = lambda copy: shutil.copy(copy / "checkpoints/checkpoint-1/stage-0.pt", copy / "checkpoints/checkpoint-3")  # noqa: E731
    case("foreign", foreign, "checkpoints/checkpoint-3")

    # The update of step 3 leaves a NaN in the second stage's weights only: both processes stop, nothing is saved.
    step, calls = torch.optim.AdamW.step, {"n": 0}

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= 3 and rank == 1:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    torch.optim.AdamW.step = poisoned
    try:
        nan_run = root / "nan"
        out["nan"] = _attempt(lambda: train(parse_config(tiny_argv(nan_run, **SCHEDULE))))
    finally:
        torch.optim.AdamW.step = step
    if rank == 0:
        out["nan/checkpoints"] = sorted(p.name for p in (nan_run / "checkpoints").iterdir())
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipelined")
    return spawn.run(functools.partial(_body, str(folder)), 2, folder)["ranks"]


def test_the_summary_is_printed_once(results):
    first, second = (ranks["summary"] for ranks in results)
    assert "***** run summary: " in first and "  pseudo stage: steps 0-2, blocks 2" in first
    assert "  real stage:   steps 2-4, blocks 4" in first
    assert "run summary" not in second


def test_a_schedule_that_ends_before_the_checkpoint_is_refused_on_every_process(results):
    for ranks in results:
        assert ranks["short"].startswith("InputError: resume_from_checkpoint: ")
        assert "checkpoint-4 is at step 4, past the end of this schedule" in ranks["short"]
    assert results[0]["short/unchanged"]


def test_a_damaged_stage_file_is_refused_on_every_process_before_anything_changes(results):
    for ranks in results:
        assert (
            ranks["truncated"].startswith("InputError: ")
            and "checkpoint-3/stage-1.pt: not a torch.save file" in (ranks["truncated"])
        )
    assert results[0]["truncated/unchanged"]


def test_a_stage_file_that_does_not_fit_is_refused_after_loading_on_every_process_and_changes_nothing(results):
    """Only the first process's file is from another checkpoint: the second, whose part loaded, stops too."""
    first, second = (ranks["foreign"] for ranks in results)
    expected = "checkpoint-3 does not fit this run (resume_from_checkpoint: the checkpoint's pipeline (split"
    assert first.startswith("InputError: resume_from_checkpoint: ") and expected in first
    assert second.startswith("InputError: resume_from_checkpoint: ") and expected in second
    assert second.endswith(" (process 0)")
    assert results[0]["foreign/unchanged"]


def test_one_process_with_non_finite_weights_stops_both_without_saving(results):
    for ranks in results:
        assert ranks["nan"].startswith(
            "NonFiniteLossError: non-finite weights or optimizer state after step 3 (real stage): stopped without "
            "saving the checkpoint; last good checkpoint: "
        ), ranks["nan"]
    assert results[0]["nan/checkpoints"] == ["checkpoint-1", "checkpoint-2"]
