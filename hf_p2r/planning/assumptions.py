"""The planner's inputs that need no model: training precisions, the machine's assumptions and the bounds of every
size the planner takes. Torch-free, so that `hf-p2r plan --help` and its argument errors answer at once (the CLI builds
its parser from these).

Every number the planner takes is bounded here, far above any real machine or run and far below what would make its
work or its arithmetic blow up (the model's own sizes are bounded by `hf_p2r.models.p2r.sharing_p2r.validate_layout`).
"""

import dataclasses
import math
from dataclasses import dataclass

from ..errors import InputError

GiB = 2**30
MAX_GPUS = 1 << 20  # GPUs in one run (the largest clusters have ~10^5)
MAX_GPUS_PER_NODE = 1 << 10  # (an NVL72 rack: 72)
MAX_MEMORY = 1 << 60  # bytes of one GPU's or one node's memory: 1 EiB
MAX_SEQ_LEN = 1 << 24  # tokens per sequence
MAX_BATCH = 1 << 30  # sequences per micro-batch or per step
MAX_RATE = 1e30  # FLOP/s, bytes/s and updates/s assumed


# The trainer's optimizers (its `optimizer` field): what a parameter's optimizer state is sized as.
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of a training recipe.

    `optimizer` counts every optimizer byte per parameter element, including an fp32 master copy when the weights
    are kept in low precision; `optimizer_per_tensor` is AdamW's `step` counter (one fp32 scalar per parameter
    tensor in torch's AdamW; Megatron and DeepSpeed keep one per group, so 0 there); `moment` is one of Adam's two
    moments per element (Muon keeps one buffer of that size per matrix element and no step counter, so a Muon
    matrix costs `optimizer - moment` per element).
    """

    name: str
    weight: int
    grad: int
    optimizer: int
    optimizer_per_tensor: int
    activation: int
    description: str
    moment: int


PRECISIONS = {
    p.name: p
    for p in (
        Precision("mixed", 2, 4, 12, 0, 2, "bf16 weights, fp32 grads, fp32 master + Adam (Megatron, DeepSpeed)", 4),
        Precision("amp", 4, 4, 8, 4, 2, "fp32 weights and Adam, bf16 compute (Accelerate bf16, FSDP2 fp32 shards)", 4),
        Precision("fp32", 4, 4, 8, 4, 4, "fp32 everything (torch AdamW)", 4),
        Precision("bf16", 2, 2, 4, 4, 2, "bf16 everything, Adam moments in bf16 (torch AdamW)", 2),
    )
}


@dataclass(frozen=True)
class Hardware:
    """The machine, and the named assumptions of the cost model (defaults: 8 x H100 80GB nodes)."""

    gpu_memory: int = 80 * 10**9
    cpu_memory: int | None = None  # per node; None: not checked
    gpus_per_node: int = 8
    peak_flops: float = 989e12  # dense bf16 FLOP/s per GPU (H100 SXM)
    mfu: float = 0.40  # share of peak the matmuls reach (Frontier reports 32-38% end to end)
    intra_node_bandwidth: float = 150e9  # bytes/s per GPU a collective achieves over NVLink
    inter_node_bandwidth: float = 25e9  # bytes/s per GPU across nodes (200 Gb/s InfiniBand per GPU)
    pcie_bandwidth: float = 25e9  # bytes/s per GPU between host and device
    cpu_adam_params_per_second: float = 1e9  # CPU Adam updates per second, per node
    reserved_gpu_bytes: int = 2 * GiB  # CUDA context, NCCL buffers, allocator fragmentation

    def __post_init__(self):
        """Every field a number within its bound (`InputError` naming it): memory sizes 1 B to `MAX_MEMORY` (the
        reserve may be 0), rates positive up to `MAX_RATE`, `mfu` in (0, 1]."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "cpu_memory" and value is None:
                continue
            if field.name == "gpus_per_node":
                check_int(field.name, value, 1, MAX_GPUS_PER_NODE)
            elif field.name in ("gpu_memory", "cpu_memory", "reserved_gpu_bytes"):
                check_int(field.name, value, 0 if field.name == "reserved_gpu_bytes" else 1, MAX_MEMORY)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"{field.name} must be a finite number, got {value!r}")
            elif not 0 < value <= (1 if field.name == "mfu" else MAX_RATE):
                bound = "1 (a share of the peak)" if field.name == "mfu" else f"{MAX_RATE:g}"
                raise InputError(f"{field.name} must be positive and at most {bound}, got {value!r}")


def check_int(name: str, value, low: int, high: int) -> int:
    """`value` if it is an integer from `low` to `high`; else `InputError` naming `name` (a field, or a flag)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {value!r}")
    shown = value if abs(value) < 10**18 else f"{value:.3g}"
    if value < low:
        raise InputError(f"{name} must be at least {low}, got {shown}")
    if value > high:
        raise InputError(f"{name} must be at most {high}, got {shown}")
    return value
