"""A model of granular offload's step time: the device's compute time without offload, the bus, and the host's
work, each phase at a measured throughput (`HostRates`: benchmarks/offload_host.py measures them on a machine), put
together along the critical path of each design. Plain arithmetic (no torch): the planner uses it.

One optimizer step of `micro_batches` micro-batches with `offloaded_parameters` in CPU memory moves, per micro-batch,
the offloaded weights in (`weight_bytes` each, once for the forward, once for the backward, once more for a
recomputation) and costs the host, by design:

- gradients summed on the host (`grad_accumulation="host"`): each micro-batch's gradient parts go out
  (`grad_bytes` each) and the host converts the first and adds each later one to a fp32 sum (and takes its norm),
  while that micro-batch's backward runs; at the end of each backward the trainer waits for what is left;
- summed on the device (`"device"`): one `accumulation_bytes` copy per parameter per step, at the end of the last
  backward; the host touches nothing (the copy lands in the gradient);
- the update (`optimizer_step="host"`): an AdamW step per parameter (`update_parameters_per_second`) and the bf16
  copies to send next (`copy_bytes_per_second`), exposed where the design cannot hide it: "after_backward" hides it
  behind the next forward up to the first offloaded block it needs, "during_backward" behind the last micro-batch's
  backward too, "delayed" behind a whole step;
- `optimizer_step="device_chunked"`: no host work, but the masters, gradients and AdamW moments cross the bus in both
  directions after the backward (nothing hides it).

Assumptions (a GPU run checks them: `make gpu-report`'s offload parts): copies and compute overlap perfectly
(the bus costs only what exceeds the compute it runs beside), the host's phases run one at a time at their measured
rates, a micro-batch's forward is a third of its compute and its backward two thirds, and the offloaded blocks are
spread over the depth ending at the last one (`spread_layers`), so the first one the next forward needs comes after
about a block's share of it.
"""

from dataclasses import dataclass, field

__all__ = ["DESIGNS", "Design", "HostRates", "OffloadStep", "StepTime", "predict_step_seconds", "spread_layers"]


@dataclass(frozen=True)
class HostRates:
    """What the host does per second (measured by benchmarks/offload_host.py; the defaults are a 16-core server's
    order of magnitude, for the planner only)."""

    update_parameters_per_second: float = 1.0e9  # fp32 AdamW steps (torch's fused CPU AdamW)
    accumulate_bytes_per_second: float = 20e9  # fp32 sum += a bf16 part, bytes of the sum read and written
    copy_bytes_per_second: float = 20e9  # dtype-converting copies (bf16 <-> fp32), bytes written
    norm_bytes_per_second: float = 30e9  # a vector norm over fp32, bytes read


@dataclass(frozen=True)
class Design:
    """One way of running the offloaded blocks (`GranularOffload`'s options)."""

    grad_accumulation: str = "host"  # or "device"
    update: str = "after_backward"  # or "during_backward", "delayed"
    optimizer_step: str = "host"  # or "device_chunked"
    accumulation_bytes: int = 4  # "device": bytes per element of the sums (fp32 4, bf16 2)

    @property
    def name(self) -> str:
        if self.optimizer_step == "device_chunked":
            return f"device_chunked, {self.grad_accumulation} sums"
        return f"{self.update}, {self.grad_accumulation} sums"


DESIGNS = {
    "today": Design(),
    "today, device_chunked": Design(optimizer_step="device_chunked"),
    "device sums": Design(grad_accumulation="device"),
    "device sums, during_backward": Design(grad_accumulation="device", update="during_backward"),
    "device sums, delayed": Design(grad_accumulation="device", update="delayed"),
    "device sums, device_chunked": Design(grad_accumulation="device", optimizer_step="device_chunked"),
}


def spread_layers(count: int, num_blocks: int) -> list[int]:
    """`count` of `num_blocks` block indices, evenly spaced and ending at the last block.

    Spacing lets each offloaded block's copy overlap the compute of the resident blocks before it; the first blocks
    are offloaded last because nothing runs before them in forward to hide their copy.

    >>> spread_layers(4, 8), spread_layers(2, 8), spread_layers(3, 8)
    ([1, 3, 5, 7], [3, 7], [2, 5, 7])
    """
    return sorted(num_blocks - 1 - (i * num_blocks) // count for i in range(count))


@dataclass(frozen=True)
class OffloadStep:
    """The offload work of one optimizer step: `offloaded_parameters` in `offloaded_blocks` equal blocks of the
    model's `num_blocks` (spread by `spread_layers`)."""

    offloaded_parameters: int
    micro_batches: int
    offloaded_blocks: int
    num_blocks: int
    weight_bytes: int = 2  # per element sent to the device (the compute dtype: bf16)
    grad_bytes: int = 2  # per element of a gradient part sent back ("host" sums: the compute dtype)
    reads: int = 2  # fetches per micro-batch of each offloaded block: forward and backward (3 with recomputation)
    uses: float = 1.0  # depths per offloaded block (a pseudo model's shared blocks run at several)


@dataclass
class StepTime:
    """A predicted step: its seconds and where they go beyond the device's compute."""

    compute: float
    parts: dict[str, float] = field(default_factory=dict)  # exposed seconds by phase
    host_work: dict[str, float] = field(default_factory=dict)  # host seconds by phase, hidden or not
    bus: dict[str, float] = field(default_factory=dict)  # bytes per step by direction

    @property
    def seconds(self) -> float:
        return self.compute + sum(self.parts.values())

    @property
    def vs_no_offload(self) -> float:
        return self.compute / self.seconds


def _finish(arrivals: list[float], each: float) -> float:
    """When one worker is done with jobs of `each` seconds arriving at `arrivals` (in that order)."""
    done = 0.0
    for arrival in arrivals:
        done = max(done, arrival) + each
    return done


def predict_step_seconds(
    compute_seconds: float,
    step: OffloadStep,
    design: Design,
    rates: HostRates,
    host_to_device: float,
    device_to_host: float,
) -> StepTime:
    """The step time of `step` under `design`: `compute_seconds` (the device's step without offload), the bus at
    `host_to_device` / `device_to_host` bytes per second and the host at `rates` (see the module docstring)."""
    n, m, k = step.offloaded_parameters, step.micro_batches, step.offloaded_blocks
    result = StepTime(compute_seconds)
    if n == 0 or k == 0:
        return result
    micro = compute_seconds / m
    forward, backward = micro / 3, 2 * micro / 3
    depths = [(index + 0.5) / step.num_blocks for index in spread_layers(k, step.num_blocks)]
    # When each offloaded block is reached: in the next forward (lowest first), in a backward (highest first).
    reached = [forward * depth for depth in depths]
    landed = [backward * (1 - depth) for depth in reversed(depths)]
    # Each micro-batch fetches every block once per read, but the last one's forward copy serves its backward too.
    weights_in = m * (step.reads * step.uses - 1 / k) * n * step.weight_bytes
    if design.grad_accumulation == "host":
        grads_out = m * step.uses * n * step.grad_bytes
    else:
        grads_out = n * design.accumulation_bytes
    result.bus = {"to_device": weights_in, "to_host": grads_out}
    result.parts["bus"] = max(0.0, weights_in / host_to_device - compute_seconds)  # only what exceeds the compute
    if design.grad_accumulation == "host":  # each backward waits, at its end, for the host's sums of its parts
        first = n * 4 / rates.copy_bytes_per_second  # the first part converted to fp32
        later = n * (2 * 4 / rates.accumulate_bytes_per_second + 4 / rates.norm_bytes_per_second)
        result.host_work["accumulate"] = first + (m - 1) * later
        result.parts["accumulate"] = sum(
            max(0.0, _finish(landed, work / k) - backward) for work in [first] + [later] * (m - 1)
        )
    else:  # one copy out per parameter, as the last backward passes each block
        result.parts["gradient copy"] = max(0.0, _finish(landed, grads_out / k / device_to_host) - backward)
    if design.optimizer_step == "device_chunked":  # masters, gradients, moments in; masters, moments, copies out
        crossing = n * (4 + 4 + 8) / host_to_device + n * (4 + 8 + step.weight_bytes) / device_to_host
        result.parts["device_chunked step"] = crossing
        return result
    update = n / rates.update_parameters_per_second + n * step.weight_bytes / rates.copy_bytes_per_second
    result.host_work["update"] = update
    each = update / k
    if design.update == "delayed":  # the next step's whole compute hides it
        exposed = max(0.0, update - compute_seconds)
    elif design.update == "during_backward":  # from each block's landing in the last backward, in that order
        done = _finish(landed, each) - backward  # after the backward: the next forward needs the last one first
        exposed = max(0.0, done - reached[0])
    else:  # from the backward's end, in the order the next forward needs them: it waits for each
        exposed = max(0.0, max((j + 1) * each - reached[j] for j in range(k)))
    result.parts["update"] = exposed
    return result
