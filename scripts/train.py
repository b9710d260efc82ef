"""Train a P2R model: pseudo stage -> delink -> real stage, in one run.

    accelerate launch --num_processes 1 scripts/train.py --config configs/demo.yaml [--FIELD VALUE ...]

Exit codes: 0 done; 2 bad configuration; 1 other expected errors (missing files, non-finite loss); 128 + signal
number when SIGTERM / SIGINT stopped the run after saving a checkpoint (143 / 130).
"""

import sys

from hf_p2r.training import NonFiniteLossError, parse_config, train


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ValueError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    try:
        return train(config)
    except (ValueError, OSError, NonFiniteLossError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
