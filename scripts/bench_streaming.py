"""Benchmark: a streaming run of the demo against a map-style run on the same data."""

# The benchmark is benchmarks/streaming.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.streaming import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
