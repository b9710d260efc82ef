"""Granular CPU offload on one GPU: throughput by offload ratio, the largest real model trainable at each ratio, and
the host<->device copy bandwidth."""

# The benchmark is benchmarks/offload.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.offload import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
