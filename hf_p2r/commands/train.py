"""`hf-p2r train`: the trainer (`hf_p2r.train`) in this process, for one CPU or one GPU.

    hf-p2r train --config configs/demo.yaml [--FIELD VALUE ...]

Every argument goes to the trainer's own parser (`hf-p2r train --help` lists its fields). For several processes
(DDP, FSDP2, DeepSpeed, pipelines) start the same module with a launcher: `accelerate launch -m hf_p2r.train ...` or
`torchrun ... -m hf_p2r.train ...`. Nothing heavy is imported until the command runs.
"""

import argparse

from . import add_command

HELP = "train a P2R model: pseudo stage -> delink -> real stage (several processes: accelerate launch -m hf_p2r.train)"


def register(subparsers: argparse._SubParsersAction) -> None:
    # Every token is the trainer's (no option of this parser, not even --help): its parser reads them.
    parser = add_command(subparsers, "train", HELP, None, run, add_help=False, prefix_chars="\0")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    from ..train import main

    return main(args.trainer_args, prog="hf-p2r train")
