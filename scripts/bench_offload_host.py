"""The host's phases of granular offload on this machine (optimizer update, gradient accumulation, copies), and the
GPU step time they predict."""

# The benchmark is benchmarks/offload_host.py, usage and all; this script keeps the command its result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.offload_host import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
