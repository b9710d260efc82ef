"""Scale: peak host memory and start-up time per process against model size and process count, DCP checkpoint save
and load times, and a 4-process checkpoint resumed on 2 and on 1 process."""

# The benchmark is benchmarks/scale.py, usage and all; this script keeps the command every result page names (and is
# what each measured trainer process runs: `--worker`).
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
