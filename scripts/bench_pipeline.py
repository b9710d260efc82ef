"""Pipeline parallelism measured: step time and memory per schedule on 2 processes, per-stage forward/backward times,
and PipeDream-2BW's convergence against a flush schedule on the demo config."""

# The benchmark is benchmarks/pipeline.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
