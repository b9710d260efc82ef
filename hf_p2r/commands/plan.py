"""`hf-p2r plan`: per-GPU memory of the pseudo and the real model under parallel layouts, and which fit.

```bash
hf-p2r plan --config runs/p2r/pseudo --gpus 64 --gpu-memory 80GB --cpu-memory 1TB --seq-len 2048 --micro-batch 1
```
"""

import argparse
import dataclasses
import re

_FLAGS = ("gpu_memory", "cpu_memory", "gpus_per_node")  # `Hardware` fields with their own flag, not `--assume`
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """'80GB' -> 80e9 bytes, '1TiB' -> 2**40 (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB or 512GiB, got {text!r}")
    return int(float(match[1]) * _UNITS[match[2].upper()])


HELP = "memory per GPU and estimated step time of parallel layouts (DDP, ZeRO, FSDP2, TP, PP, offload)"


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..planning.assumptions import PRECISIONS, Hardware  # torch-free: --help and argument errors answer at once

    assumptions = ", ".join(f"{f.name}={f.default:g}" for f in dataclasses.fields(Hardware) if f.name not in _FLAGS)
    parser = subparsers.add_parser(
        "plan",
        help=HELP,
        description=(
            "Per-GPU bytes of weights, gradients, optimizer state and activations of the pseudo and the real model "
            "under DDP, ZeRO-1/2, FSDP2/ZeRO-3, tensor and pipeline parallelism and granular CPU offload, computed "
            "on the meta device; the layouts that fit, fastest first."
        ),
        epilog=f"Cost-model assumptions (override with --assume NAME=VALUE): {assumptions}.",
    )
    parser.add_argument(
        "--config", required=True, help="a model folder or config.json (p2r or llama), or a trainer YAML"
    )
    parser.add_argument("--gpus", type=int, required=True, help="total number of GPUs")
    parser.add_argument("--gpu-memory", type=parse_size, default="80GB", help="memory per GPU (default 80GB)")
    parser.add_argument("--cpu-memory", type=parse_size, help="CPU memory per node, for offload (default: unchecked)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the YAML's block_size, else 2048)")
    parser.add_argument("--micro-batch", type=int, help="sequences per GPU per forward (default: YAML, else 1)")
    parser.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default: gpus x micro-batch x accumulation)"
    )
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        help="; ".join(f"{p.name}: {p.description}" for p in PRECISIONS.values()) + " (default: YAML, else mixed)",
    )
    parser.add_argument("--num-unique-layers", type=int, help="k of the pseudo model when --config is a real model")
    parser.add_argument("--max-tp", type=int, help="largest tensor-parallel degree (default: GPUs per node)")
    parser.add_argument(
        "--max-pp", type=int, default=1, help="largest pipeline degree; each under gpipe, 1f1b and 2bw (default 1)"
    )
    parser.add_argument("--top", type=int, default=10, help="rows per model (default 10)")
    parser.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE", help="override an assumption")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..planning.assumptions import PRECISIONS, Hardware
    from ..planning.plan import Workload, plan, pseudo_and_real, read_config
    from ..planning.report import format_plan

    for name in ("gpus", "gpus_per_node", "seq_len", "micro_batch", "global_batch", "max_tp", "max_pp", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    found = read_config(args.config)
    pseudo, real = pseudo_and_real(found.config, args.num_unique_layers)
    micro_batch = args.micro_batch or found.micro_batch or 1
    workload = Workload(
        seq_len=args.seq_len or found.seq_len or 2048,
        micro_batch=micro_batch,
        global_batch=args.global_batch or args.gpus * micro_batch * found.gradient_accumulation_steps,
        precision=PRECISIONS[args.precision or found.precision or "mixed"],
    )
    hardware = Hardware(
        gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory,
        gpus_per_node=args.gpus_per_node,
        **_assumptions(args.assume),
    )
    max_tp = args.max_tp or hardware.gpus_per_node
    results = {
        name: plan(config, args.gpus, workload, hardware, max_tp=max_tp, max_pp=args.max_pp, model=name)
        for name, config in (("pseudo", pseudo), ("real", real))
    }
    print(format_plan(results, {"pseudo": pseudo, "real": real}, workload, hardware, args.gpus, args.top, found.notes))
    return 0


def _assumptions(items: list[str]) -> dict:
    from ..planning.assumptions import Hardware

    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.name not in _FLAGS}
    values = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in fields or not text:
            raise ValueError(f"--assume {item!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
        try:
            values[name] = type(fields[name].default)(float(text))
        except ValueError:
            raise ValueError(f"--assume {item!r}: {text!r} is not a number") from None
        if values[name] <= 0:
            raise ValueError(f"--assume {item!r}: must be positive")
    return values
