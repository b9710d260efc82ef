"""What every training run does around its steps, whatever engine runs them: the step log (progress bar, metrics
records, messages), the stop on SIGTERM / SIGINT, the output folder's lock, checks and preparation, the checks before
a save, and the end-of-run summary.
"""

import contextlib
import errno
import fcntl
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from ..checkpoint.card import usage_code
from ..config import CheckpointArguments, LoggingArguments
from ..errors import InputError, printable, redact
from .metrics import (
    METRICS_FILE,
    PLOT_FILE,
    append_metrics,
    peak_memory_gb,
    plot_losses,
    read_metrics,
    stage_summary,
    truncate_metrics,
)
from .resume.checkpoints import CHECKPOINTS, TrainState, all_finite, discard_after, list_checkpoints

# What a run writes into output_dir (and what overwrite_output_dir removes; nothing else there is touched).
OUTPUTS = (CHECKPOINTS, "pseudo", "real", METRICS_FILE, PLOT_FILE, "logs", "train_config.yaml")
# The file in output_dir that the run's main process holds locked while it runs (`holding_output_dir`).
LOCK_FILE = ".hf-p2r-run.lock"


class NonFiniteLossError(RuntimeError):
    """The training loss, the weights or the optimizer state became NaN or infinite; the run stopped without saving
    (every checkpoint it kept has finite weights and optimizer state)."""


class StepLog:
    """The run's log: each step's loss and time into the state and the progress bar, every `logging_steps` (and at
    the end) the logged measures, the records of metrics.jsonl (and the trackers), and messages to the user."""

    def __init__(
        self,
        accelerator: Accelerator,
        state: TrainState,
        args: LoggingArguments,
        total_steps: int,
        tokens_per_step: int,
        depth: int,
        metrics_path: Path,
    ):
        self.accelerator, self.state, self.args, self.depth = accelerator, state, args, depth
        self.tokens_per_step, self.metrics_path = tokens_per_step, metrics_path
        self.interval_steps, self.interval_time = 0, 0.0  # in this process since the last record, for tokens_per_s
        self.progress = tqdm(
            total=total_steps,
            initial=state.step,
            desc=state.stage(depth),
            dynamic_ncols=True,
            disable=not accelerator.is_local_main_process,
        )

    def step(self, loss: float, lr: float, elapsed: float) -> None:
        """One optimizer step done: its mean loss, learning rate and training time (seconds)."""
        state = self.state
        state.step += 1
        state.train_time_s += elapsed
        self.interval_steps, self.interval_time = self.interval_steps + 1, self.interval_time + elapsed
        state.log_loss_sum += loss
        state.log_steps += 1
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def measures(self, final: bool, lr: float, shared_lr: float, grad_norm) -> dict:
        """The record's measures when one is due (every `logging_steps`, and the last step), else {}."""
        state = self.state
        if not (state.step % self.args.logging_steps == 0 or final):
            return {}
        measure = dict(
            loss=state.log_loss_sum / state.log_steps,
            lr=lr,
            **({"lr_shared": shared_lr} if shared_lr < lr else {}),  # shared_lr_scale: depth
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens_per_s=self.tokens_per_step * self.interval_steps / self.interval_time,
            train_time_s=state.train_time_s,
            memory_gb=peak_memory_gb(self.accelerator.device),
        )
        state.log_loss_sum, state.log_steps = 0.0, 0
        self.interval_steps, self.interval_time = 0, 0.0
        return measure

    def record(self, **values) -> None:
        """One metrics.jsonl record at this step (written by the main process; counted by all, for a resume), its
        numbers also to the trackers."""
        state = self.state
        record = {"step": state.step, "stage": state.stage(self.depth), "num_blocks": state.num_blocks}
        record.update(num_hidden_layers=state.num_hidden_layers, tokens=state.tokens, flops=state.flops, **values)
        state.metrics_records += 1
        if self.accelerator.is_main_process:
            append_metrics(self.metrics_path, record)
        numbers = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers and self.accelerator.trackers:
            self.accelerator.log(numbers, step=state.step)

    def say(self, message: str) -> None:
        """A line for the user (one per machine), above the progress bar."""
        say(self.accelerator, message)

    def stage_changed(self) -> None:
        self.progress.set_description(self.state.stage(self.depth))


def say(accelerator: Accelerator, message: str) -> None:
    """`message` on one line, from each machine's main process."""
    if accelerator.is_local_main_process:
        tqdm.write(message)


class OutputDirLock:
    """One run per output_dir: an exclusive `flock` on `output_dir/.hf-p2r-run.lock`, which holds the holder's pid
    and host. The kernel releases it when the holding process ends in any way (kill -9 and out-of-memory included),
    so a lock a dead process left is taken over by the next run; `release` removes the file (and `output_dir`, when
    taking the lock created it and nothing else is there). A second `OutputDirLock` on the same folder, from another
    process or this one, is refused (`InputError` naming the holder's pid), as long as the first one is held.
    Where the file system has no `flock` (some network file systems), the run goes on without a lock (`held` False).

    ```python
    >>> lock = OutputDirLock("runs/p2r")   # InputError("output_dir: runs/p2r is in use by another run (process ...)")
    >>> lock.release()
    ```
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._created = _missing_folders(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._fd = None
        try:
            self._fd = self._acquire()
        except BaseException:
            self._remove_created()
            raise

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _acquire(self) -> int | None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
                os.close(fd)
                who = f"process {printable(holder[0], 20)}" if holder else "another process"
                who += f" on {printable(holder[1], 80)}" if len(holder) > 1 and holder[1] != _host() else ""
                raise InputError(
                    f"output_dir: {printable(self.output_dir)} is in use by another run ({who}); one run per "
                    "output_dir: wait for it to end, or choose another output_dir"
                ) from None
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)  # no flock on this file system: no lock, no lock file
                    return None
                raise
            try:  # the holder may have released (removed) the file between our open and our lock: the lock is ours
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))  # only if the file is still the path's
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {_host()}\n".encode(), 0)
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent); then `output_dir` if this lock made it and it is
        empty (a run that failed before writing anything leaves nothing behind)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while held: a run waiting on this file retries on a new one
            os.close(fd)
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self._created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
        self._created = []


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and its ancestors that do not exist, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _host() -> str:
    return socket.gethostname() or "localhost"


@contextlib.contextmanager
def holding_output_dir(accelerator: Accelerator, output_dir: Path) -> Iterator[None]:
    """The run's life, with its main process holding `output_dir`'s lock (`OutputDirLock`), released on every way
    out (done, an error, a signal; a killed process's by the kernel). When another run holds it, every process raises
    the main process's one line (one collective: call on every process, before anything else touches output_dir)."""
    lock, caught, problem = None, None, None
    if accelerator.is_main_process:
        try:
            lock = OutputDirLock(output_dir)
        except (InputError, OSError) as error:  # in use; or output_dir cannot be made (a file there, no permission)
            caught, problem = error, (isinstance(error, InputError), str(error))
    if accelerator.num_processes > 1:
        [problem] = broadcast_object_list([problem])
    if caught is not None:
        raise caught
    if problem is not None:
        in_use, text = problem
        raise (InputError if in_use else OSError)(text)
    if lock is not None and not lock.held:
        say(
            accelerator, f"output_dir: {printable(output_dir)}'s file system has no flock: this run holds no lock on it"
        )
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def check_output_dir(saving: CheckpointArguments, resumed: bool) -> list[Path]:
    """The earlier outputs in `output_dir` (`OUTPUTS`; `saving`: the run's checkpointing section), after checking what
    the run may do with them, changing nothing: a fresh run refuses them unless overwrite_output_dir; a resumed run
    needs a readable metrics.jsonl, and an output_dir that is not the checkpoint it resumes from, nor inside it.
    Called on every process (so all of them stop on an error)."""
    output_dir, source = Path(saving.output_dir), saving.resume_from_checkpoint
    if source and source != "latest":  # the run's outputs would land in the checkpoint it reads
        checkpoint, output = Path(os.path.realpath(source)), Path(os.path.realpath(output_dir))
        if output == checkpoint or output.is_relative_to(checkpoint):
            raise InputError(
                f"output_dir: {printable(output_dir)} is the checkpoint it resumes from ({printable(source)}) or lies "
                "inside it: give the run's output_dir (the checkpoint's ../..) or a new folder"
            )
    existing = [output_dir / name for name in OUTPUTS if (output_dir / name).exists()]
    if not resumed and existing and not saving.overwrite_output_dir:
        raise FileExistsError(
            f"output_dir: {output_dir} already holds a run ({', '.join(p.name for p in existing)}); pass "
            "--resume_from_checkpoint latest to continue it or --overwrite_output_dir true to start over"
        )
    if resumed:
        read_metrics(output_dir / METRICS_FILE)  # a damaged record is refused now, not after the load
    return existing


def prepare_output_dir(
    accelerator: Accelerator, output_dir: Path, record: dict, resumed: TrainState | None, existing: list[Path]
) -> None:
    """Once the run is built (and resumed): a resumed run drops what came after its checkpoint (newer checkpoints,
    later metrics records), a fresh one removes the `existing` outputs that `check_output_dir` found; both write the
    resolved configuration (`record`: `TrainConfig.to_dict`). The main process changes the folder."""
    accelerator.wait_for_everyone()  # every process has loaded before the main one changes anything
    if accelerator.is_main_process:
        if resumed is not None:
            output_dir.mkdir(parents=True, exist_ok=True)  # a checkpoint of another run may start a new folder
            discard_after(output_dir, resumed.step)
            truncate_metrics(output_dir / METRICS_FILE, resumed.metrics_records)
        else:
            for path in existing:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            output_dir.mkdir(parents=True, exist_ok=True)
        # The resolved configuration, usable as --config to repeat the run.
        config_text = redact(yaml.safe_dump(record, sort_keys=False))  # (no token in any output)
        (output_dir / "train_config.yaml").write_text(config_text, encoding="utf-8")
    accelerator.wait_for_everyone()


def check_finite(accelerator: Accelerator, output_dir: Path, state: TrainState, depth: int, what: str, *objects):
    """Raise `NonFiniteLossError` before `what` is saved unless every tensor of `objects` (parameters, optimizer
    state) is finite on every process (`all_finite`: one pass, one collective)."""
    if not all_finite(accelerator, *objects):
        raise NonFiniteLossError(
            f"non-finite weights or optimizer state after step {state.step} ({state.stage(depth)} stage): stopped "
            f"without saving the {what}; {_last_good(output_dir)}"
        )


def non_finite_loss(loss: float, output_dir: Path, state: TrainState, depth: int) -> NonFiniteLossError:
    """The error for a non-finite training `loss` in the step after `state.step` (nothing of that step is saved)."""
    return NonFiniteLossError(
        f"non-finite training loss ({loss}) at step {state.step + 1} ({state.stage(depth)} stage): stopped without "
        f"saving; {_last_good(output_dir)}"
    )


def _last_good(output_dir: Path) -> str:
    last = list_checkpoints(output_dir)
    return (
        f"last good checkpoint: {last[-1] if last else 'none'}; try a lower learning_rate, more warmup_steps or "
        "max_grad_norm"
    )


def finish_run(
    output_dir: Path, title: str, wall_time_s: float, remote_code: bool, resumed: TrainState | None = None
) -> None:
    """The main process's end of a run: the loss curve (`loss.png`), then the summary (`run_summary`) on stdout."""
    records = read_metrics(output_dir / METRICS_FILE)
    if not plot_losses(records, output_dir / PLOT_FILE, title):
        print(f"matplotlib is not installed: skipped {output_dir / PLOT_FILE} (pip install 'hf-p2r[plot]')")
    print(run_summary(output_dir, records, wall_time_s, remote_code, resumed), flush=True)


def run_summary(
    output_dir: Path, records: list[dict], wall_time_s: float, remote_code: bool, resumed: TrainState | None = None
) -> str:
    """What a finished run reached and where it is: each stage's steps, blocks, final validation loss and tokens/s
    (`stage_summary` of its metrics records), the wall time of this invocation and its training steps' (a resumed run:
    `resumed`, the state it started from; the whole run's training time beside), the output folders and files there,
    and the commands that come next (load, publish, convert)."""
    lines = [f"***** run summary: {output_dir} *****"]
    stages = stage_summary(records)
    width = max((len(stage["stage"]) for stage in stages), default=0)
    deepest = max((depth for stage in stages for depth in stage["depths"]), default=None)
    for stage in stages:
        blocks = " -> ".join(str(n) for n in stage["blocks"])
        figures = [f"steps {stage['steps'][0]}-{stage['steps'][1]}", f"blocks {blocks}"]
        if stage["depths"] != [deepest]:  # a shallow stage, or one that grows
            figures.append("layers " + " -> ".join(str(n) for n in stage["depths"]))
        if stage["flops"] is not None:
            figures.append(f"{stage['tokens']:,} tokens, {stage['flops']:.3g} FLOPs")
        if stage["val_loss"] is not None:
            figures.append(f"val_loss {stage['val_loss']:.4f}")
        if stage["tokens_per_s"] is not None:
            figures.append(f"{stage['tokens_per_s']:,.0f} tokens/s")
        lines.append(f"  {stage['stage'] + ' stage:':<{width + 7}} " + ", ".join(figures))
    training = sum(stage["train_time_s"] for stage in stages)
    if resumed is None:
        lines.append(f"  wall time: {_duration(wall_time_s)}, of which training steps {_duration(training)}")
    else:
        lines.append(
            f"  wall time: {_duration(wall_time_s)} (resumed at step {resumed.step}), of which training steps "
            f"{_duration(max(0.0, training - resumed.train_time_s))}; training steps of the whole run "
            f"{_duration(training)}"
        )
    outputs = {
        "real": "the trained model",
        "pseudo": "the pseudo model at the end of its stage",
        METRICS_FILE: "the logged metrics, one JSON record per line",
        PLOT_FILE: "the loss curve",
        CHECKPOINTS: "resume with --resume_from_checkpoint latest",
    }
    found = [(output_dir / name, text) for name, text in outputs.items() if (output_dir / name).exists()]
    names = [str(path) + os.sep * path.is_dir() for path, _ in found]
    width = max(map(len, names), default=0)
    lines += ["  outputs:", *(f"    {name:<{width}}  {text}" for name, (_, text) in zip(names, found))]
    real, pseudo, cli = output_dir / "real", output_dir / "pseudo", hf_p2r_command()
    # with remote_code the modeling code is in real/, else `import hf_p2r` registers it; its tokenizer is there too
    load = usage_code(
        str(real), import_hf_p2r=not remote_code, remote_code=remote_code, has_tokenizer=True, one_line=True
    )
    lines += [
        "  next:",
        f"    load it (Python):      {load}",
        f"    publish it on the Hub: {cli} push {shlex.quote(str(real))} USER/NAME",
    ]
    if pseudo.exists():
        delinked = shlex.quote(str(output_dir / "pseudo-delinked"))
        lines.append(
            f"    delink pseudo/:        {cli} convert {shlex.quote(str(pseudo))} {delinked}  (the model the real "
            "stage started from)"
        )
    return "\n".join(lines)


def hf_p2r_command() -> str:
    """How to run `hf-p2r` from this shell: its name when that finds this Python's, else its path (a virtual
    environment that is not activated), relative to the current folder when it is under it."""
    script = Path(sys.executable).with_name("hf-p2r")
    on_path = shutil.which("hf-p2r")
    if not script.exists() or (on_path and Path(on_path).resolve() == script.resolve()):
        return "hf-p2r"
    relative = os.path.relpath(script)
    return shlex.quote(str(script) if relative.startswith("..") else relative)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class StopOnSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current step (it then saves a checkpoint and returns 128 + the
    first signal's number).

    A second Ctrl-C acts at once (SIGINT's previous handler is put back). SIGTERM stays a request however often it
    comes: sent to a one-process launcher's process group, it reaches the trainer twice, from the sender and as the
    launcher's death signal (`hf_p2r.train.stop_with_launcher`), and the second must not cut the checkpoint short.
    """

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(float(self.signum), device=device)

    def _handle(self, signum, frame):
        self.signum = self.signum or signum
        if signum == signal.SIGINT:
            signal.signal(signum, self._previous[signum])

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
