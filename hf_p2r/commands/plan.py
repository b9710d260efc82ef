"""`hf-p2r plan`: per-GPU memory of the pseudo and the real model under parallel layouts, and which fit.

```bash
hf-p2r plan --config runs/p2r/pseudo --gpus 64 --gpu-memory 80GB --cpu-memory 1TB --seq-len 2048 --micro-batch 1
```

Every number it takes is bounded (`hf_p2r.planning.assumptions`: GPUs, memory sizes, sequence length, batch sizes,
the cost model's assumptions; the model's sizes by its config's validation), so bad input ends within seconds in one
line (argparse's usage and its line for a flag it cannot parse), and no input makes the planner's work grow without
limit.

Per-GPU bytes of weights, gradients, optimizer state and activations of the pseudo and the real model under DDP,
ZeRO-1/2, FSDP2/ZeRO-3, tensor and pipeline parallelism (split as the trainer splits it) and granular CPU offload,
counted from the model's config; the layouts that fit, fastest first. The config's sizes and every number given are
checked first (bad input: one line, exit 2).
"""

import argparse
import dataclasses
import math
import os
import re
import sys
from typing import TYPE_CHECKING

from . import add_command

if TYPE_CHECKING:
    from ..planning.plan import PlanInput

_FLAGS = ("gpu_memory", "cpu_memory", "gpus_per_node")  # `Hardware` fields with their own flag, not `--assume`
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """'80GB' -> 80e9 bytes, '1TiB' -> 2**40 (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024), from 1 byte
    to `MAX_MEMORY` (1 EiB)."""
    from ..planning.assumptions import MAX_MEMORY

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text[:100])
    if len(text) > 100 or not match or match[2].upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB or 512GiB, got {text[:100]!r}")
    size = float(match[1]) * _UNITS[match[2].upper()]
    if not 1 <= size <= MAX_MEMORY:  # inf included
        raise argparse.ArgumentTypeError(f"expected a size from 1 byte to 1 EiB, got {text!r}")
    return int(size)


HELP = "memory per GPU and estimated step time of parallel layouts (DDP, ZeRO, FSDP2, TP, PP, offload)"
DESCRIPTION = (__doc__ or "").rsplit("\n\n", 1)[-1]  # `--help` shows this docstring's last paragraph


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..planning.assumptions import OPTIMIZERS, PRECISIONS, Hardware  # torch-free: --help and errors answer at once

    assumptions = ", ".join(f"{f.name}={f.default:g}" for f in dataclasses.fields(Hardware) if f.name not in _FLAGS)
    epilog = (
        f"Cost-model assumptions (override with --assume NAME=VALUE): {assumptions}. Each model's table shows its "
        "--top best layouts (those that fit first, fastest first; when none fits, the three closest to fitting) and "
        "says how many it leaves out; --all shows every layout sized."
    )
    parser = add_command(subparsers, "plan", HELP, DESCRIPTION, run, epilog=epilog)
    parser.add_argument(
        "--config", required=True, help="a model folder or JSON config (p2r, p2r_moe or llama), or a trainer YAML"
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
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="the trainer's optimizer: adamw (two moments per element) or muon (one buffer per element of the blocks' "
        "matrices, AdamW's two elsewhere) (default: YAML, else adamw)",
    )
    parser.add_argument("--num-unique-layers", type=int, help="k of the pseudo model when --config is a real model")
    parser.add_argument("--max-tp", type=int, help="largest tensor-parallel degree (default: GPUs per node)")
    parser.add_argument(
        "--max-pp",
        type=int,
        default=1,
        help="largest pipeline degree; each under every schedule the trainer runs (default 1)",
    )
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--top", type=int, default=10, metavar="N", help="the N best layouts per model (default 10)")
    rows.add_argument("--all", action="store_true", help="every layout sized, fitting or not, one row each")
    parser.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE", help="override an assumption")


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..planning.assumptions import (
        MAX_BATCH,
        MAX_GPUS,
        MAX_GPUS_PER_NODE,
        MAX_SEQ_LEN,
        PRECISIONS,
        Hardware,
        check_int,
    )
    from ..planning.memory import parameter_tensors
    from ..planning.plan import Workload, check_builds, plan, pseudo_and_real
    from ..planning.report import format_plan

    # The model's sizes bound --num-unique-layers, the layouts sized bound --top.
    bounds = {"gpus": MAX_GPUS, "gpus_per_node": MAX_GPUS_PER_NODE, "seq_len": MAX_SEQ_LEN, "max_tp": MAX_GPUS}
    bounds |= {"max_pp": MAX_GPUS, "micro_batch": MAX_BATCH, "global_batch": MAX_BATCH}
    for name in (*bounds, "top", "num_unique_layers"):
        if getattr(args, name) is not None:
            check_int(f"--{name.replace('_', '-')}", getattr(args, name), 1, bounds.get(name, sys.maxsize))
    hardware = Hardware(
        gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory,
        gpus_per_node=args.gpus_per_node,
        **_assumptions(args.assume),
    )
    found = read_plan_input(args.config)
    pseudo, real = pseudo_and_real(found.config, args.num_unique_layers)
    micro_batch = args.micro_batch or found.micro_batch or 1
    workload = Workload(  # checks the sizes a trainer YAML gives, and the global batch it makes
        seq_len=args.seq_len or found.seq_len or 2048,
        micro_batch=micro_batch,
        global_batch=args.global_batch or args.gpus * micro_batch * found.gradient_accumulation_steps,
        precision=PRECISIONS[args.precision or found.precision or "mixed"],
        optimizer=args.optimizer or found.optimizer or "adamw",
    )
    max_tp = args.max_tp or hardware.gpus_per_node
    models = {"pseudo": pseudo, "real": real}
    try:
        check_builds(pseudo)
    except (ValueError, TypeError, KeyError, AttributeError) as error:  # fields the validators do not cover
        message = f"{args.config}: cannot build the model from it: {type(error).__name__}: {error}"
        raise InputError(message[:500]) from None
    tensors = {name: parameter_tensors(config) for name, config in models.items()}
    results = {}
    for name, config in models.items():
        results[name] = plan(
            config,
            args.gpus,
            workload,
            hardware,
            max_tp=max_tp,
            max_pp=args.max_pp,
            model=name,
            tensors=tensors[name],
            notes=found.notes,
        )
    top = None if args.all else args.top
    print(format_plan(results, models, workload, hardware, args.gpus, top, found.notes, tensors=tensors))
    return 0


def read_plan_input(path: str | os.PathLike) -> "PlanInput":
    """What `--config` says: a model folder or JSON file (`hf_p2r.planning.plan.read_config`), or a trainer YAML
    (`scripts/train.py --config`, read by the trainer's own reader: same keys, same errors), whose model fields,
    `block_size` (sequence length), `per_device_batch_size`, `gradient_accumulation_steps`, `mixed_precision` and
    `activation_checkpointing` are handed to the planner as plain values."""
    from ..planning.plan import PlanInput, read_config

    if not str(path).endswith((".yaml", ".yml")):
        return read_config(path)
    from ..config import parse_config

    run = parse_config(["--config", str(path)])
    notes = []
    vocab_size = run.model.vocab_size
    if vocab_size is None:
        vocab_size = 256
        notes.append(f"{path}: vocab_size is not set (the tokenizer decides it at training time); assumed 256")
    config = run.p2r_config(vocab_size=vocab_size, num_blocks=run.initial_blocks(), special_tokens={})
    return PlanInput(
        config,
        seq_len=run.data.block_size,
        micro_batch=run.compute.per_device_batch_size,
        gradient_accumulation_steps=run.compute.gradient_accumulation_steps,
        precision={"bf16": "amp", "fp16": "amp", "no": "fp32"}.get(run.compute.mixed_precision),
        optimizer=run.optim.optimizer,
        recompute=run.model.activation_checkpointing,
        notes=notes,
    )


def _assumptions(items: list[str]) -> dict:
    """{field: value} of `--assume NAME=VALUE` items; `Hardware` checks the values' bounds."""
    from ..errors import InputError
    from ..planning.assumptions import Hardware

    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.name not in _FLAGS}
    values = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in fields or not text:
            raise InputError(f"--assume {item[:100]!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
        try:
            number = float(text)
        except ValueError:
            raise InputError(f"--assume {item[:100]!r}: {text[:100]!r} is not a number") from None
        if not math.isfinite(number) or number <= 0:
            raise InputError(f"--assume {item[:100]!r}: must be a positive finite number")
        values[name] = type(fields[name].default)(number)
    return values
