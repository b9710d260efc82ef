"""MoE convergence benchmark: the real MoE model trained from scratch against P2R (pseudo MoE -> delink -> real MoE)."""

# The benchmark is benchmarks/moe_convergence.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.moe_convergence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
