"""The pipeline schedule simulator checked against measured CPU runs, then used at scale to reproduce PipeDream-2BW's
comparison of 2BW, GPipe and 1F1B-flush."""

# The benchmark is benchmarks/pipeline_sim.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.pipeline_sim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
