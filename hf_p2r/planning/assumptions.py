"""The planner's inputs that need no model: training precisions and the machine's assumptions. Torch-free, so that
`hf-p2r plan --help` and its argument errors answer at once (the CLI builds its parser from these)."""

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Precision:
    """Bytes per element of a training recipe.

    `optimizer` counts every optimizer byte per parameter element, including an fp32 master copy when the weights
    are kept in low precision; `optimizer_per_tensor` is AdamW's `step` counter (one fp32 scalar per parameter
    tensor in torch's AdamW; Megatron and DeepSpeed keep one per group, so 0 there).
    """

    name: str
    weight: int
    grad: int
    optimizer: int
    optimizer_per_tensor: int
    activation: int
    description: str


PRECISIONS = {
    p.name: p
    for p in (
        Precision("mixed", 2, 4, 12, 0, 2, "bf16 weights, fp32 grads, fp32 master + Adam (Megatron, DeepSpeed)"),
        Precision("amp", 4, 4, 8, 4, 2, "fp32 weights and Adam, bf16 compute (Accelerate bf16, FSDP2 fp32 shards)"),
        Precision("fp32", 4, 4, 8, 4, 4, "fp32 everything (torch AdamW)"),
        Precision("bf16", 2, 2, 4, 4, 2, "bf16 everything, Adam moments in bf16 (torch AdamW)"),
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
