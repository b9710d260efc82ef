"""The table `hf-p2r plan` prints."""

from ..models.p2r import P2RConfig
from .memory import GiB, ParameterTensor, block_parameters, host_memory_per_process, parameter_tensors
from .plan import Estimate, Hardware, Workload

COLUMNS = ("#", "layout", "weights", "grads", "optim", "activ", "buffers", "GPU total", "CPU/node", "step s", "bubble")
COLUMNS += ("tok/s",)


def layout_name(estimate: Estimate) -> str:
    """E.g. 'dp8 tp8 fsdp2/zero3 offload50% recompute', 'dp2 pp4 2bw ddp'."""
    layout = estimate.layout
    parts = [f"dp{layout.dp}"]
    parts += [f"tp{layout.tp}"] if layout.tp > 1 else []
    parts += [f"pp{layout.pp}", layout.schedule] if layout.pp > 1 else []
    parts.append(layout.sharding)
    parts += [f"offload{layout.offload:.0%}"] if layout.offload else []
    parts += ["recompute"] if layout.recompute else []
    return " ".join(parts)


def format_rows(estimates: list[Estimate], top: int | None = None) -> str:
    """The `top` best layouts (None: all) as a markdown table (GiB), with the engine that runs each."""
    rows = []
    for rank, e in enumerate(estimates[:top], start=1):
        m = e.memory
        gib = [f"{value / GiB:.1f}" for value in (m.weights, m.grads, m.optimizer, m.activations, m.buffers, m.total)]
        fits = "" if e.fits else " (does not fit)"
        rows.append(
            [str(rank), layout_name(e) + fits, *gib, f"{e.cpu_per_node / GiB:.0f}", f"{e.step_seconds:.3g}"]
            + [f"{e.bubble:.0%}", f"{e.tokens_per_second:.3g}", e.engine]
        )
    header = [*COLUMNS, "engine"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(header, widths)) + " |"]
    lines.append("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    lines += ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def format_plan(
    results: dict[str, list[Estimate]],
    configs: dict[str, P2RConfig],
    workload: Workload,
    hardware: Hardware,
    gpus: int,
    top: int | None,
    notes: list[str] = (),
    tensors: dict[str, list[ParameterTensor]] | None = None,
) -> str:
    """Both models' tables with a header stating the workload and the assumptions.

    A table shows the `top` fastest layouts that fit, or, when none fits, the 3 closest to fitting; `top=None`
    shows every layout. A line under a table says how many it leaves out and how to see them (`--top N`, `--all`).
    `tensors`: {name: `parameter_tensors(configs[name])`}, when the caller has them already."""
    cpu = f", {hardware.cpu_memory / 10**9:.0f} GB CPU per node" if hardware.cpu_memory else ""
    lines = [
        f"{gpus} GPUs ({hardware.gpus_per_node} per node), {hardware.gpu_memory / 10**9:.0f} GB each{cpu}; "
        f"{workload.global_batch} x {workload.seq_len} tokens per step, micro-batch {workload.micro_batch}, "
        f"precision {workload.precision.name} ({workload.precision.description})",
        f"assumed: {hardware.peak_flops / 1e12:.0f} TFLOP/s peak at {hardware.mfu:.0%} MFU, "
        f"{hardware.intra_node_bandwidth / 1e9:.0f} GB/s in a node, {hardware.inter_node_bandwidth / 1e9:.0f} GB/s "
        f"across nodes, {hardware.pcie_bandwidth / 1e9:.0f} GB/s PCIe, {hardware.reserved_gpu_bytes / GiB:.0f} GiB "
        "reserved per GPU; memory in GiB on the most loaded GPU, step time assumes no overlap; bubble: a pipeline's "
        "idle share, (pp - 1) / (m + pp - 1) flushed (gpipe, 1f1b), none for 2bw in steady state",
        *notes,
    ]
    for name, estimates in results.items():
        config = configs[name]
        fitting = sum(e.fits for e in estimates)
        what = (
            f"{config.num_blocks} stored block{'s' * (config.num_blocks > 1)} run at {config.num_hidden_layers} "
            f"depths ({config.sharing_pattern})"
            if config.share_layers
            else f"{config.num_hidden_layers} blocks"
        )
        held = tensors[name] if tensors is not None else parameter_tensors(config)
        parameters = _count(sum(t.numel for t in held))
        if getattr(config, "num_experts", 0):
            # Memory follows all the experts, FLOPs the k a token is routed to.
            active = _count(round(sum(t.active_numel for t in held)))
            parameters = f"{parameters} parameters ({active} active per token: top-{config.num_experts_per_tok} of "
            parameters += f"{config.num_experts} experts)"
        else:
            parameters += " parameters"
        lines += ["", f"{name} model: {what}, {parameters}; {fitting} of {len(estimates)} fit"]
        shown = estimates[:top] if top is None or fitting else estimates[: min(top, 3)]
        lines.append(format_rows(shown))
        if len(shown) < len(estimates):
            which = "fastest first" if fitting else "closest to fitting first"
            lines.append(
                f"{len(shown)} of {len(estimates)} layouts shown ({which}): --top N shows N, --all shows every one"
            )
    real = "real" if "real" in configs else list(configs)[-1]  # the real model's memory is the run's peak
    held = tensors[real] if tensors is not None else parameter_tensors(configs[real])
    lines += ["", host_memory_line(held, gpus)]
    return "\n".join(lines)


def host_memory_line(tensors: list[ParameterTensor], processes: int) -> str:
    """The real model's host memory per process in a CPU run of `processes` processes (`host_memory_per_process`):
    FSDP2 over all of them, 2 stages of sharded replicas where `processes` is even, and one process."""
    parameters, block = sum(t.numel for t in tensors), block_parameters(tensors)
    layouts = []
    if processes > 1:
        layouts.append((f"FSDP2 over {processes}", dict(stages=1, sharded=True)))
    if processes > 2 and processes % 2 == 0:
        layouts.append((f"2 stages x {processes // 2} sharded", dict(stages=2, sharded=True)))
    figures = [
        f"{name} {_size(host_memory_per_process(parameters, processes, block_parameters=block, **kw).total)}"
        for name, kw in layouts
    ]
    figures.append(f"one process {_size(host_memory_per_process(parameters, 1).total)}")
    return (
        f"host memory per process of a CPU run of the real model on {processes} process{'es' * (processes > 1)} (fp32 "
        f"AdamW, gloo; above the ~0.5 GiB of Python, torch and the corpus; benchmarks/scale.md): " + "; ".join(figures)
    )


def _size(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / 2**20:.0f} MiB"


def _count(number: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.3g}{unit}"
    return str(number)


__all__ = ["format_plan", "format_rows", "layout_name"]
