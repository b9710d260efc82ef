"""`hf-p2r export CHECKPOINT DST`: a DCP training checkpoint as a Hugging Face folder (P2R, Llama or Mixtral), read
one tensor at a time; see `hf_p2r.training.resume.export.export_checkpoint`.

Write the model of a training checkpoint saved with checkpoint_format: dcp (output_dir/checkpoints/checkpoint-N) as a
Hugging Face folder: the model is rebuilt from the checkpoint's trainer_state.json (the run's configuration and
tokenizer) and its weights are read from the DCP shards one tensor at a time, whichever processes wrote them, never the
whole model in memory. The options are `hf-p2r convert`'s: by default the real model (a pseudo checkpoint is delinked),
as the converter writes it from the trainer's own folder. DST appears complete or not at all.
"""

import argparse

from . import add_command
from .convert import add_output_options, write_output

HELP = "write a DCP training checkpoint (checkpoint_format: dcp) as a P2R, Llama or Mixtral folder (streamed)"
DESCRIPTION = (__doc__ or "").rsplit("\n\n", 1)[-1]  # `--help` shows this docstring's last paragraph


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "export", HELP, DESCRIPTION, run)
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="DCP checkpoint folder (.metadata, *.distcp, trainer_state.json), or a run's output_dir: its newest "
        "checkpoint",
    )
    parser.add_argument("dst", metavar="DST", help="output folder (written beside it, renamed at the end)")
    add_output_options(
        parser,
        blocks_help="blocks of the output (default: the real model, one block per layer); the checkpoint's own count "
        "keeps a pseudo model as it is, a count between delinks partially (as hf-p2r convert)",
    )


def run(args: argparse.Namespace) -> int:
    from ..training.resume.export import export_checkpoint

    return write_output(args, export_checkpoint, args.checkpoint)
