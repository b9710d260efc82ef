"""`hf-p2r convert SRC DST`: stream a pseudo checkpoint into a real (or less shared, or deeper) one, or export a real
one to vanilla Llama / Mixtral; see `hf_p2r.convert_pseudo_to_real`.

Delink a pseudo checkpoint (dense or mixture-of-experts) on disk: every layer gets its own copy of its block's weights
(experts and router included); grow a checkpoint in depth (--num-hidden-layers: each new layer a copy of one of SRC's);
or export a real P2R checkpoint to vanilla Llama (--target llama) or Mixtral (--target mixtral). Each output shard is a
safetensors header followed by byte ranges of the source, copied by the kernel (copy_file_range, or reflinks on XFS and
btrfs), so the model is never in memory and torch is loaded only for --dtype casts and --verify. Only files within SRC
are read (a Hugging Face cache snapshot's links into its blobs included); carried files that are not (a link out of SRC,
a FIFO) are skipped with a line on stderr. DST appears complete or not at all: on an error, Ctrl-C or SIGTERM it is left
as it was.
"""

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from . import add_command

HELP = "convert a pseudo checkpoint into a real one, or a real one into Llama/Mixtral (streamed, atomic)"
DESCRIPTION = (__doc__ or "").rsplit("\n\n", 1)[-1]  # `--help` shows this docstring's last paragraph


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..models.p2r.sharing_p2r import GROWTH_PATTERNS  # plain Python: --help answers at once

    parser = add_command(subparsers, "convert", HELP, DESCRIPTION, run)
    parser.add_argument(
        "src",
        metavar="SRC",
        help="checkpoint folder (config.json + safetensors, single or sharded): pseudo, or real with --target "
        "llama/mixtral or --dtype",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="output folder (written to a temporary folder beside it, renamed at the end; a link is written through)",
    )
    add_output_options(
        parser,
        blocks_help="partial delink to K blocks (default: the real model, one block per layer); K must keep every "
        "depth's block (the error lists the values that do); SRC's own count only copies (with --dtype: casts)",
    )
    parser.add_argument(
        "--num-hidden-layers",
        type=int,
        metavar="L",
        help="grow SRC's depth d to L layers (a delink along the depths; one block per layer unless "
        "--num-unique-layers): new layer i copies layer i mod d (--growth stack) or floor(i*d/L) (interleave)",
    )
    parser.add_argument(
        "--growth",
        choices=GROWTH_PATTERNS,
        default="stack",
        help="how --num-hidden-layers maps new layers to SRC's (default stack: G_stack's copies of the whole model)",
    )
    parser.add_argument(
        "--function-preserving",
        action="store_true",
        help="with --num-hidden-layers: the later copies of each layer start with zero output projections (o_proj, "
        "down_proj), so the grown model computes SRC's function",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="reopen the output before the rename and check every tensor's name, shape, dtype and bytes against the "
        "source's; prints what was verified (on stderr)",
    )


def add_output_options(parser: argparse.ArgumentParser, blocks_help: str) -> None:
    """The options of the folder written (`hf-p2r convert`'s, and `hf-p2r export`'s, which converts alike): blocks,
    shard size, dtype, target, --overwrite."""
    from ..checkpoint.targets import TARGETS  # torch-free: --help and argument errors answer at once

    parser.add_argument("--num-unique-layers", type=int, metavar="K", help=blocks_help)
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest output shard: a size like 5GB or 500MB, or a number of bytes (default 5GB)",
    )
    parser.add_argument("--dtype", metavar="DTYPE", help="cast the weights to float32, float16, bfloat16 or float64")
    parser.add_argument(
        "--target",
        choices=list(TARGETS),
        default="p2r",
        help="; ".join(f"{name}: {target.help}" for name, target in TARGETS.items())
        + f". {' and '.join(name for name, target in TARGETS.items() if target.real_only)} write the real model, from "
        "a pseudo or a real one",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import convert_pseudo_to_real

    growth = dict(
        num_hidden_layers=args.num_hidden_layers, growth=args.growth, function_preserving=args.function_preserving
    )
    return write_output(args, convert_pseudo_to_real, args.src, **growth, verify=args.verify)


def write_output(args: argparse.Namespace, write: Callable[..., Any], source: str, **options) -> int:
    """`write(source, DST, ...)` with the options of the folder written (`add_output_options`) and `options`, what it
    logs as lines on stderr (`notes_on_stderr`); prints DST. The run of `hf-p2r convert` and `hf-p2r export`."""
    with notes_on_stderr(args.command):
        out = write(
            source,
            args.dst,
            num_unique_layers=args.num_unique_layers,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            target=args.target,
            overwrite=args.overwrite,
            **options,
        )
    print(out)
    return 0


class _Lines(logging.Formatter):
    def __init__(self, command: str):
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        kind = "warning: " if record.levelno >= logging.WARNING else ""
        return f"hf-p2r {self.command}: {kind}{record.getMessage()}"


@contextlib.contextmanager
def notes_on_stderr(command: str) -> Iterator[None]:
    """What the converter logs (skipped files, a conversion that changes nothing, what --verify checked) as lines
    `hf-p2r COMMAND: [warning: ]...` on stderr; stdout keeps only DST's path."""
    logger = logging.getLogger("hf_p2r.checkpoint")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lines(command))
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]
