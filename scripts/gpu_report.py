"""One command that measures hf-p2r on one GPU (issue 29); --dry-run checks every part at tiny size on CPU."""

# The report is benchmarks/gpu_report.py, usage and all; this script is the command `make gpu-report` runs.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.gpu_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
