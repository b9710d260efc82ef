"""Training throughput and training-state bytes: P2R (real) vs transformers' Llama, and pseudo vs real."""

# The benchmark is benchmarks/throughput.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
