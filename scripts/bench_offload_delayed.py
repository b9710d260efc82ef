"""What granular offload's delayed update costs in loss: the trainer on CPU with the exact and the delayed update,
side by side."""

# The benchmark is benchmarks/offload_delayed.py, usage and all; this script keeps the command its result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.offload_delayed import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
