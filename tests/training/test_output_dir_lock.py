"""One run per output_dir (issue 36): two trainers started on one output_dir both exited 0, their metrics.jsonl records
and checkpoints interleaved. The run's main process now holds an exclusive `flock` on `output_dir/.hf-p2r-run.lock`
for the run's life (`hf_p2r.training.run.OutputDirLock`); a second run is refused in one line naming the holder's pid;
the kernel releases the lock of a process that dies, so a killed run's lock is taken over. Tested with real
processes where the point is processes."""

import os
import signal
import subprocess
import time

import pytest

from hf_p2r.errors import InputError
from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.run import LOCK_FILE, OutputDirLock

from .helpers import PYTHON, REPO, run_trainer, subprocess_env, tiny_argv


def test_a_second_lock_is_refused_naming_the_holder_and_the_first_is_released(tmp_path):
    output_dir = tmp_path / "new" / "run"
    lock = OutputDirLock(output_dir)
    assert lock.held and (output_dir / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    message = rf"^output_dir: {output_dir} is in use by another run \(process {os.getpid()}\); one run per output_dir"
    with pytest.raises(InputError, match=message):
        OutputDirLock(output_dir)  # (flock: another open file of this process conflicts like another process's)
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / "new").exists(), "the folders the lock made, empty, are removed with it"
    OutputDirLock(output_dir).release()


def test_a_run_that_fails_releases_the_lock_and_leaves_no_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint: no checkpoint in"):
        train(parse_config(tiny_argv(tmp_path / "run", resume_from_checkpoint="latest")))
    assert not (tmp_path / "run").exists()


def test_a_lock_a_killed_process_left_is_taken_over(tmp_path):
    """kill -9 runs no cleanup: the lock file stays, naming a dead process; the kernel released its lock."""
    output_dir = tmp_path / "run"
    code = (
        "import os, signal, sys\n"
        "from hf_p2r.training.run import OutputDirLock\n"
        "OutputDirLock(sys.argv[1])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.Popen([PYTHON, "-c", code, str(output_dir)], env=subprocess_env(), cwd=REPO)
    assert killed.wait(timeout=120) == -signal.SIGKILL
    assert (output_dir / LOCK_FILE).read_text().split()[0] == str(killed.pid)
    assert train(parse_config(tiny_argv(output_dir, pseudo_steps=1, real_steps=1, eval_steps=0))) == 0
    assert not (output_dir / LOCK_FILE).exists() and (output_dir / "real/config.json").is_file()


def _wait_for(condition, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited {process.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_second_trainer_on_the_same_output_dir_is_refused_naming_the_first(tmp_path):
    """Two real trainers: the second exits 2 with one line naming the first's pid and changes nothing; the first,
    stopped by SIGTERM, saves its checkpoint, exits 143 and releases the lock; its metrics are its own. The first is
    paused (SIGSTOP, its lock held) while the second starts and is refused, so that it does not train meanwhile."""
    output_dir = tmp_path / "run"
    long_run = tiny_argv(output_dir, pseudo_steps=2, real_steps=10**6, save_steps=10**6, eval_steps=0)
    log = open(tmp_path / "first.log", "w+")  # (a pipe would fill with the progress bar and block it)
    first = subprocess.Popen(
        [PYTHON, "-m", "hf_p2r.train", *long_run, "--logging_steps", "10"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=subprocess_env(),
        cwd=REPO,
    )
    try:
        _wait_for(lambda: any("loss" in r for r in read_metrics(output_dir / "metrics.jsonl")), first, timeout=300)
        first.send_signal(signal.SIGSTOP)
        second = run_trainer(tiny_argv(output_dir, pseudo_steps=2, real_steps=2))
        first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "error" in line]
        assert errors == [
            f"train.py: error: output_dir: {output_dir} is in use by another run (process {first.pid}); one run per "
            "output_dir: wait for it to end, or choose another output_dir"
        ], second.stderr[-3000:]
        assert first.poll() is None, "the first run goes on"
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log.close()
    assert first.returncode == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()[-3000:]
    assert not (output_dir / LOCK_FILE).exists()
    steps = [record["step"] for record in read_metrics(output_dir / "metrics.jsonl") if "loss" in record]
    assert steps and steps == sorted(set(steps)), "one run's records, in order"
    (checkpoint,) = list_checkpoints(output_dir)  # the first run's, saved at its stop
    assert int(checkpoint.name.removeprefix("checkpoint-")) >= steps[-1]


def test_a_file_system_without_flock_runs_without_a_lock_and_says_so(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from accelerate import Accelerator

    from hf_p2r.training.run import holding_output_dir

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with holding_output_dir(Accelerator(cpu=True), tmp_path / "run"):
        assert (tmp_path / "run").is_dir()
    assert "run's file system has no flock: this run holds no lock on it" in capsys.readouterr().out
    assert not (tmp_path / "run").exists(), "no lock file left, and the folder it made removed"
