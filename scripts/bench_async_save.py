"""Benchmark: how long a DCP checkpoint save blocks the training loop, synchronous against `checkpoint_async`."""

# The benchmark is benchmarks/async_save.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.async_save import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
