"""Subcommands of the `hf-p2r` command line (see `hf_p2r/cli.py`)."""

import argparse
from collections.abc import Callable


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    help: str,
    description: str | None,
    run: Callable[[argparse.Namespace], int | None],
    **options,
) -> argparse.ArgumentParser:
    """The parser of the command `name`: its line `help` in `hf-p2r --help`, its `description` in its own, `options`
    for argparse; running it calls `run` with the parsed arguments."""
    parser = subparsers.add_parser(name, help=help, description=description, **options)
    parser.set_defaults(func=run)
    return parser
