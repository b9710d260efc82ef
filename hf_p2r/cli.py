"""`hf-p2r`: a thin command line over hf_p2r's public functions.

Each subcommand lives in `hf_p2r/commands/<name>.py` and exposes `register(subparsers)`, which adds its parser and
sets `func` (called with the parsed arguments; returns an exit code or None), and `HELP`, its line in `hf-p2r --help`.
Only the command being run builds its parser, and heavy imports happen inside `func`: `hf-p2r --help`, every
command's `--help` and argument errors import neither torch nor transformers (tests/test_cli.py checks it), and
`hf-p2r convert` needs them only for a dtype cast or `--verify`. Expected errors print one line on stderr, without a
traceback, and exit 2 for bad input (a file, a field, an argument) or 1 for a failure at run time (a full disk):
`hf_p2r.errors.exit_code`; a name in it is shown with its control characters escaped (`hf_p2r.errors.printable`).
Whatever a command prints (its output, its messages, logs and warnings, a traceback) is redacted on its way out: the
Hub token never appears (`hf_p2r.errors.run_redacted`).

SIGTERM and SIGHUP (`kill`, `timeout`, a SLURM job ending, a closed terminal) stop a command like Ctrl-C does: the
partial output is removed, one line is printed and the exit status is 128 + the signal number.
"""

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from .commands import convert, env, export, plan, push, train
from .errors import exit_code, one_line, run_redacted

COMMANDS = {"train": train, "convert": convert, "export": export, "push": push, "plan": plan, "env": env}
# Errors that mean "bad input or environment", not a bug: shown as one line (exit status: `exit_code`).
USER_ERRORS = (ValueError, OSError, KeyError)
# Signals that end a command the way Ctrl-C (SIGINT) does.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by a SIGTERM/SIGHUP: a KeyboardInterrupt, so every cleanup Ctrl-C runs runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="hf-p2r", description="Pseudo-to-Real pretraining tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The others only show their help line.
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, command in COMMANDS.items():
        if name == chosen:
            command.register(subparsers)
        else:
            subparsers.add_parser(name, help=command.HELP)
    args = parser.parse_args(argv)
    return run_redacted(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    try:
        with _stop_on_signals():
            return args.func(args) or 0
    except KeyboardInterrupt as error:
        signum = getattr(error, "signum", signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"hf-p2r {args.command}: {what}", file=sys.stderr)
        return 128 + signum
    except USER_ERRORS as error:
        message = str(error) if not isinstance(error, KeyError) else f"missing {error}"
        print(f"hf-p2r {args.command}: error: {one_line(message)}", file=sys.stderr)
        return exit_code(error)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into `Stopped` while the command runs (Python only handles signals in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    # Only where the default (termination) applies: `nohup` sets SIGHUP to be ignored, and that must stay so.
    previous = {
        signum: signal.signal(signum, stop) for signum in STOP_SIGNALS if signal.getsignal(signum) == signal.SIG_DFL
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
