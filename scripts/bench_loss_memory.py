"""Peak memory of the causal-LM loss, forward + backward: plain (every logit) vs chunked linear cross-entropy."""

# The benchmark is benchmarks/loss_memory.py, usage and all; this script keeps the command every result page names.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, which holds `benchmarks`

from benchmarks.loss_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
