"""Convergence benchmark: the real model trained from scratch against P2R (pseudo stage -> delink -> real stage)."""

# The benchmark is benchmarks/convergence/, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.convergence.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
