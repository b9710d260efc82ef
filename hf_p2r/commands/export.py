"""`hf-p2r export CHECKPOINT DST`: a DCP training checkpoint as a Hugging Face folder (P2R, Llama or Mixtral), read
one tensor at a time; see `hf_p2r.training.export.export_checkpoint`."""

import argparse

HELP = "write a DCP training checkpoint (checkpoint_format: dcp) as a P2R, Llama or Mixtral folder (streamed)"


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..checkpoint.targets import TARGETS  # torch-free: --help and argument errors answer at once

    parser = subparsers.add_parser(
        "export",
        help=HELP,
        description="Write the model of a training checkpoint saved with checkpoint_format: dcp "
        "(output_dir/checkpoints/checkpoint-N) as a Hugging Face folder: the model is rebuilt from the checkpoint's "
        "trainer_state.json (the run's configuration and tokenizer) and its weights are read from the DCP shards one "
        "tensor at a time, whichever processes wrote them, never the whole model in memory. The options are "
        "`hf-p2r convert`'s: by default the real model (a pseudo checkpoint is delinked), as the converter writes it "
        "from the trainer's own folder. DST appears complete or not at all.",
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="DCP checkpoint folder (.metadata, *.distcp, trainer_state.json), or a run's output_dir: its newest "
        "checkpoint",
    )
    parser.add_argument("dst", metavar="DST", help="output folder (written beside it, renamed at the end)")
    parser.add_argument(
        "--num-unique-layers",
        type=int,
        metavar="K",
        help="blocks of the output (default: the real model, one block per layer); the checkpoint's own count keeps "
        "a pseudo model as it is, a count between delinks partially (as hf-p2r convert)",
    )
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
        help="; ".join(f"{name}: {target.help}" for name, target in TARGETS.items()),
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..training.export import export_checkpoint

    out = export_checkpoint(
        args.checkpoint,
        args.dst,
        target=args.target,
        num_unique_layers=args.num_unique_layers,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    print(out)
    return 0
