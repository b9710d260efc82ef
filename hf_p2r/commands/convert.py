"""`hf-p2r convert SRC DST`: stream a pseudo checkpoint into a real (or less shared) one; see
`hf_p2r.convert_pseudo_to_real`."""

import argparse

HELP = "convert a pseudo checkpoint into a real one (streamed, atomic)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help=HELP,
        description="Delink a pseudo checkpoint (dense or mixture-of-experts) on disk: every layer gets its own copy "
        "of its block's weights (experts and router included). "
        "Each output shard is a safetensors header followed by byte ranges of the source, copied by the kernel "
        "(copy_file_range, or reflinks on XFS and btrfs), so the model is never in memory and torch is loaded only "
        "for --dtype casts and --verify.",
    )
    parser.add_argument(
        "src", metavar="SRC", help="pseudo checkpoint folder (config.json + safetensors, single or sharded)"
    )
    parser.add_argument(
        "dst", metavar="DST", help="output folder (written to a temporary folder beside it, renamed at the end)"
    )
    parser.add_argument(
        "--num-unique-layers",
        type=int,
        metavar="K",
        help="partial delink to K blocks (default: the real model, one block per layer)",
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
        choices=("p2r", "llama", "mixtral"),
        default="p2r",
        help="p2r: a P2R checkpoint, dense or MoE (default); llama: a vanilla LlamaForCausalLM checkpoint (dense "
        "models); mixtral: a vanilla MixtralForCausalLM checkpoint (MoE models without expert prototyping or dense "
        "layers)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    parser.add_argument("--verify", action="store_true", help="reopen the output and check it against the source")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import convert_pseudo_to_real

    out = convert_pseudo_to_real(
        args.src,
        args.dst,
        num_unique_layers=args.num_unique_layers,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        target=args.target,
        overwrite=args.overwrite,
        verify=args.verify,
    )
    print(out)
    return 0
