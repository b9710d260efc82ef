"""Train a P2R model: pseudo stage -> delink -> real stage, in one run.

    accelerate launch -q --num_processes 1 scripts/train.py --config configs/demo.yaml [--FIELD VALUE ...]

The trainer ships in the package as `hf_p2r.train` (`accelerate launch -m hf_p2r.train ...`, `hf-p2r train ...`); this
script is that module, kept so that every command written with it keeps working. Exit codes: `hf_p2r.train`'s.
"""

import sys

from hf_p2r.train import main, run, stop_with_launcher

__all__ = ["main", "run", "stop_with_launcher"]

if __name__ == "__main__":
    sys.exit(run())
