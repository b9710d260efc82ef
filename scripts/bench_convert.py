"""Benchmark: streaming pseudo -> real conversion (`hf-p2r convert`) against mergekit passthrough and `cp -r`."""

# The benchmark is benchmarks/convert.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
