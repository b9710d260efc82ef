"""`hf-p2r`: a thin command line over hf_p2r's public functions.

Each subcommand lives in `hf_p2r/commands/<name>.py` and exposes `register(subparsers)`, which adds its parser and
sets `func` (called with the parsed arguments; returns an exit code or None). Heavy imports happen inside `func`, so
`hf-p2r --help` is instant. Expected user errors print one line on stderr and exit 1, without a traceback.
"""

import argparse
import sys

from .commands import convert, plan, push

# Errors that mean "bad input or environment", not a bug: shown as one line.
USER_ERRORS = (ValueError, OSError, KeyError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-p2r", description="Pseudo-to-Real pretraining tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (convert, push, plan):
        command.register(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print(f"hf-p2r {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        message = str(error) if not isinstance(error, KeyError) else f"missing {error}"
        print(f"hf-p2r {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
