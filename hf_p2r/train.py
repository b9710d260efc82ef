"""The trainer's command line: pseudo stage -> delink -> real stage, in one run (`hf_p2r.training`).

    accelerate launch -q --num_processes 1 -m hf_p2r.train --config configs/demo.yaml [--FIELD VALUE ...]
    torchrun --nproc-per-node 2 -m hf_p2r.train --config ... --pipeline_parallel_size 2
    hf-p2r train --config configs/demo.yaml [--FIELD VALUE ...]      # one process, as `python -m hf_p2r.train`

(`scripts/train.py` of a source checkout is this module.) Exit codes: 0 done; 2 bad input or configuration (a field, a
damaged checkpoint, a missing file: `hf_p2r.errors.exit_code`); 1 a failure at run time (a full disk, a non-finite
loss); 128 + signal number when SIGTERM / SIGINT stopped the run after saving a checkpoint (143 / 130). Through
`accelerate launch` the launcher's own code replaces every non-zero one: 1 (with `-q`; without it, after a
CalledProcessError traceback).
"""

import contextlib
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_M_MMAP_THRESHOLD = -3  # from <malloc.h>
# glibc's malloc serves an allocation of this many bytes or more by its own mapping, returned to the system when freed.
MMAP_THRESHOLD = 128 * 1024


def malloc_policy() -> str:
    """What the trainer does with glibc's malloc at start in this environment (`set_malloc`; `hf-p2r env` says it).

    glibc's default raises its mmap threshold each time a large block is freed (up to 32 MiB), so FSDP2's all-gathered
    blocks and the optimizer's temporaries come from the heap afterwards and the pages they free stay resident: 4
    FSDP2 processes of a 55M-parameter model held 18.0 bytes per parameter per process above a tiny run with glibc's
    default, 4.9 with this setting and 5.2 with `MALLOC_MMAP_THRESHOLD_=131072` (benchmarks/malloc.md). The trainer
    fixes it at 128 KiB, glibc's starting value, unless the environment sets it."""
    if not sys.platform.startswith("linux"):
        return "left to the platform's allocator (not Linux)"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "left to the environment's MALLOC_MMAP_THRESHOLD_"
    if os.environ.get("HF_P2R_MALLOC", "").lower() == "glibc":
        return "left to glibc's default (HF_P2R_MALLOC=glibc)"
    return (
        f"mmap threshold fixed at {MMAP_THRESHOLD // 1024} KiB (freed blocks return to the system; "
        "HF_P2R_MALLOC=glibc keeps glibc's default)"
    )


def set_malloc() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` as `malloc_policy` says (mallopt, in this process, for every
    later allocation: what `MALLOC_MMAP_THRESHOLD_` does from the start); whether it was set."""
    if not malloc_policy().startswith("mmap threshold fixed"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has it as a no-op)
        return False
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


def hide_gpus_for_cpu_launch() -> None:
    """`accelerate launch --cpu`: hide the GPUs before torch starts CUDA. Otherwise torch still allocates a CPU run's
    barriers on cuda:<local rank>, which fails on a machine with fewer GPUs than processes. Call it before torch is
    imported (this module imports it only in `main`)."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@contextlib.contextmanager
def long_lived_imports() -> Iterator[None]:
    """Import the trainer's modules without the cyclic garbage collector, then move every object to its permanent
    generation (`gc.freeze`), which no later collection visits.

    Those imports (torch, transformers, accelerate, datasets) make ~700,000 objects that live as long as the process
    and leave ~12,000 garbage. Collected as they came, every full collection walked all of them: in a tiny CPU run
    (2026-11-28, the 2-core dev machine) the collections during the imports took 1.4 CPU s, and the exit (its last
    collection, then freeing the modules object by object) 1.8-2.2 CPU s, 0.4-0.5 once frozen. The garbage stays
    (peak RSS of that run 498 -> 507 MB); what the run makes later is collected as before. A collector disabled before
    stays disabled."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """Parse the trainer's arguments (`hf_p2r.config.parse_config`, torch-free: `--help` and every configuration
    error answer before torch is imported) and run it; returns the exit code. Expected errors are one line on stderr,
    `prog: error: ...` (`hf_p2r.errors.one_line`, as every command prints them)."""
    from .config import parse_config
    from .errors import exit_code, one_line

    try:
        config = parse_config(argv, prog=prog)
    except ValueError as error:
        print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)
        return 2
    hide_gpus_for_cpu_launch()
    set_malloc()  # before torch allocates anything
    with long_lived_imports():
        from .training import NonFiniteLossError, train

    try:
        return train(config)
    except (ValueError, OSError, NonFiniteLossError) as error:
        print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)  # (redacted: `run`, the cli's run_redacted)
        return exit_code(error)


def stop_with_launcher() -> None:
    """Under a launcher, on Linux: have the kernel send this process SIGTERM when the launcher dies.

    `accelerate launch` with one process (and DeepSpeed's launcher) starts the trainer with Popen + wait and forwards
    no signal, so SIGTERM to the launcher would end the launcher alone and leave the trainer running as an orphan
    that never saves. With the death signal the trainer finishes its step, saves a checkpoint and exits. (torchrun,
    accelerate's multi-process path, forwards SIGTERM itself; the death signal also covers its being killed.)

    Only under a launcher: a run started straight from a shell must survive that shell (`nohup`, `setsid`).
    """
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if not launched or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not allowed here (seccomp): run as before
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run(argv: list[str] | None = None) -> int:
    """The trainer as a process's entry point (`python -m hf_p2r.train`, a launcher's `-m hf_p2r.train`,
    `scripts/train.py`): `stop_with_launcher`, then `main`."""
    stop_with_launcher()
    from .errors import run_redacted

    return run_redacted(lambda: main(argv))  # the Hub token never printed


if __name__ == "__main__":
    sys.exit(run())
