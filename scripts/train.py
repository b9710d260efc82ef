"""Train a P2R model: pseudo stage -> delink -> real stage, in one run.

    accelerate launch -q --num_processes 1 scripts/train.py --config configs/demo.yaml [--FIELD VALUE ...]

Exit codes of `python scripts/train.py`: 0 done; 2 bad input or configuration (a field, a damaged checkpoint, a
missing file: `hf_p2r.errors.exit_code`); 1 a failure at run time (a full disk, a non-finite loss); 128 + signal number
when SIGTERM / SIGINT stopped the run after saving a checkpoint (143 / 130).
Through `accelerate launch` the launcher's own code replaces every non-zero one: 1 (with `-q`; without it, after a
CalledProcessError traceback).
"""

import ctypes
import os
import signal
import sys

# `accelerate launch --cpu`: hide the GPUs before torch starts CUDA. Otherwise torch still allocates a CPU run's
# barriers on cuda:<local rank>, which fails on a machine with fewer GPUs than processes.
if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from hf_p2r.errors import exit_code  # noqa: E402
from hf_p2r.training import NonFiniteLossError, parse_config, train  # noqa: E402

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ValueError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    try:
        return train(config)
    except (ValueError, OSError, NonFiniteLossError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return exit_code(error)


def stop_with_launcher() -> None:
    """Under a launcher, on Linux: have the kernel send this process SIGTERM when the launcher dies.

    `accelerate launch` with one process (and DeepSpeed's launcher) starts this script with Popen + wait and forwards
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


if __name__ == "__main__":
    stop_with_launcher()
    sys.exit(main())
