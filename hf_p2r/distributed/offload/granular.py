"""Granular CPU offload for training (M6-10T's second technique): chosen decoder layers live in CPU memory.

`GranularOffload(model, layers)` is applied to a model from outside; the model code knows nothing about it. The
parameters of the chosen blocks (`model.model.layers[i]`), their gradients and their optimizer state live in CPU
memory (each block's parameters, the copies sent to the device and the buffers gradients land in share one pinned
allocation when the compute device is CUDA, so their copies are asynchronous; the optimizer state is never copied);
every other parameter stays on the compute device. While the model
runs, each offloaded block is copied to the compute device just before it is needed (on a side stream, `prefetch`
positions ahead in execution order, so the copy overlaps compute) and its device copy is released after use;
gradients go back to CPU on another side stream as soon as autograd has accumulated them, and a worker thread adds
each to the parameter's CPU gradient while the backward goes on (the backward waits for a copy only while more than
`max_inflight_bytes` of gradients are in flight, and at its end for the last ones). Each offloaded gradient's norm is
taken on the compute device as it leaves (of a sum over micro-batches, by the worker that sums it), so
`clip_grad_norm_` makes no pass over CPU gradients to measure them. The optimizer step of the offloaded parameters runs
on the CPU, after the device step of the resident ones has been launched (`optimizer_step="host"`; with `overlap_step`,
block by block on the worker thread while the next forward runs, each block's fetch waiting for its own step, as the
trainer runs it), or on the compute device a bounded chunk at a time, their optimizer state kept in pinned host memory
and copied in and out with each chunk (`optimizer_step="device_chunked"`, Megatron-Core's chunked optimizer-state
offload).

    offload = GranularOffload(model, layers=0.5, device="cuda")   # or [1, 3, 5, 7], or "auto" with a budget
    optimizer = offload.build_optimizer(lr=3e-4, weight_decay=0.1)
    for batch in batches:
        model(**batch).loss.backward()              # offloaded .grad are CPU tensors after backward
        offload.clip_grad_norm_(model.parameters(), 1.0)   # torch's clip_grad_norm_, offloaded norms already taken
        optimizer.step()
        optimizer.zero_grad()
    offload.remove()                                # hooks gone, every parameter back where it was

How: the same `Parameter` objects are trained. Between training steps `p.data` is the CPU master tensor, so the
optimizer, `state_dict()` and `save_pretrained` see ordinary CPU parameters. From the start of a forward to the end
of its backward, `p.data` is a device tensor whose storage is allocated only while the block is fetched (FSDP2's
technique: `untyped_storage().resize_`), so the tensors autograd saves for backward (views of the weights) stay
valid views that are refilled before the block's backward and recomputation, and hold no memory in between. Keeping
`p.data` on the device for the whole window also keeps one gradient accumulator per parameter, so a shared block of a
pseudo model gets one gradient per backward, after its last use (with gradient accumulation, each micro-batch's
gradient is added to the CPU `.grad`). With no CUDA device, storage and compute device are both the CPU: the copies
are CPU to CPU and every other step runs unchanged.

The host off the critical path (issue 40; each an option, measured by `make gpu-report`): gradients summed on the
device and sent once per step (`grad_accumulation="device"`, told the last micro-batch by `last_micro_batch`), the
blocks updated during the backward (`update="during_backward"`, exact without clipping) or one step late
(`update="delayed"`, not exact: one step stale), several host threads (`host_threads`). Each synchronous design
equals training without offload bit for bit in fp32 on one device.

Under autocast pass `compute_dtype` (the autocast dtype): otherwise autocast caches a low-precision cast of every
offloaded weight, and autograd saves it, from forward to backward, and offload frees no weight memory (a warning
says so).

Limits: one process (no DDP/FSDP/tensor parallelism: they raise `ValueError`); weights written through `p.data`
between steps are not seen by the `compute_dtype` copies (use `p.copy_` or an optimizer step, which are).
"""

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..delay import DELAY_CORRECTIONS
from .estimates import DEFAULT_BUDGET_FRACTION, GRADIENT_ACCUMULATIONS, LayerSpec, execution_order, select_layers
from .fetch import FetchHooks
from .gradients import GradientPath
from .placement import Block, Placement, check_supported
from .step import DEFAULT_CHUNK_BYTES, OPTIMIZER_STEPS, UPDATES, OptimizerStep

__all__ = ["GranularOffload"]


class GranularOffload(Placement, FetchHooks, GradientPath, OptimizerStep):
    """Offload the chosen blocks of `model` to CPU memory for training; see the module docstring.

    Args:
        model: a decoder with blocks at `model.model.layers` (P2R, Llama, ...), in one process (no DDP/FSDP/TP).
        layers: which blocks, see `select_layers`: indices, a ratio, "auto", or None.
        device: the compute device. Resident parameters and all buffers are moved there; offloaded parameters are
            moved to (pinned) CPU memory. Default: the device of the model's first parameter.
        prefetch: how many positions ahead in execution order (forward, then backward) blocks are copied.
        compute_dtype: dtype of the device working copies of offloaded weights (e.g. `torch.bfloat16` under bf16
            autocast, like FSDP2's `MixedPrecisionPolicy(param_dtype=...)`: autocast then has nothing to cast and
            cache, and their gradients come back in that dtype and are accumulated in the master dtype). Default:
            the parameter's dtype.
        budget_bytes, activation_bytes: for `layers="auto"` (see `select_layers`); on CUDA the budget defaults to
            85% of the device's memory.
        max_inflight_bytes: gradient bytes whose copy to the host may be in flight before the backward waits for the
            oldest (CUDA; default: the largest offloaded block's gradients).
        optimizer_step: where `build_optimizer`'s optimizer steps the offloaded parameters: "host" (the CPU) or
            "device_chunked" (the compute device, `chunk_bytes` of parameters, gradients and state at a time; see
            `step_in_chunks`). The pinned state of "device_chunked" is not in `estimate_host_bytes`.
        overlap_step: "host" only: `build_optimizer`'s step returns once the resident part is launched and steps each
            offloaded block on the worker thread, each block's next fetch waiting for its own step (`step_overlapped`;
            `synchronize` before reading offloaded weights or optimizer state other than through a forward or
            `state_dict`). `clip_grad_norm_` then leaves the offloaded gradients' scaling to that step. torch.optim
            classes only; another class steps its offloaded part at once, as without it.
        materialize: for a model on the meta device, `materialize(modules, device)` allocates and initialises the
            tensors of `modules` on `device` (`hf_p2r.distributed.materialize`, as `apply_offload` passes it): called
            once for the resident modules (on the compute device), then for each offloaded block (on the CPU) just
            before it is copied into its slab, so the host holds the offloaded blocks and one block at most.
        grad_accumulation: where an offloaded parameter's gradient is summed over a step's micro-batches: "host"
            (each backward's part sent and added on the CPU by the worker) or "device" (summed on the compute device
            in a buffer per parameter, in `accumulation_dtype`, default the master's; sent once, by the step's last
            backward, and handed over as `.grad` without a host copy: `last_micro_batch` says which backward that is).
        last_micro_batch: called at each training forward: whether its backward ends the step's accumulation (the
            trainer passes Accelerate's `sync_gradients`). A backward that does not hands nothing over and waits for
            nothing: offloaded `.grad` stay None (summed on the device, or by the worker) until the last one. Default:
            every backward is a step's last.
        update: when `optimizer_step="host"` updates the offloaded blocks (`UPDATES`): "after_backward" (as
            `overlap_step`), "during_backward" (each block once its last gradient has landed, while the backward
            goes on: no `clip_grad_norm_` then) or "delayed" (ZeRO-Offload's delayed parameter update: step t's update
            runs during step t+1, which sends the weights of before it; `synchronize` drains it). The last two imply
            `overlap_step`.
        delay_correction: "delayed" only: "error_feedback" corrects the stale update as PipeDream-2BW's is
            (`hf_p2r.distributed.delay`), at the cost of two more fp32 copies of the offloaded weights on the host.
        host_threads: worker threads (gradient sums, block updates): several update several blocks at once.

    Apply it after the model has its final structure and placement (after `accelerator.prepare(model)`, after
    `delink`); do not move the model while it is applied (`remove()` first). Build the optimizer after applying it.
    Between a training forward and the end of its backward, offloaded parameters hold device tensors that are empty
    except while their block runs: read weights after backward (or after a `torch.no_grad()` forward).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSpec,
        *,
        device: str | torch.device | None = None,
        prefetch: int = 1,
        compute_dtype: torch.dtype | None = None,
        budget_bytes: int | None = None,
        activation_bytes: int = 0,
        max_inflight_bytes: int | None = None,
        optimizer_step: str = "host",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        overlap_step: bool = False,
        materialize: Callable[[list[nn.Module], torch.device], object] | None = None,
        grad_accumulation: str = "host",
        accumulation_dtype: torch.dtype | None = None,
        last_micro_batch: Callable[[], bool] | None = None,
        update: str = "after_backward",
        delay_correction: str = "none",
        host_threads: int = 1,
    ):
        check_supported(model)
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"offload: compute device must be cpu or cuda, got {self.device}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"offload: prefetch must be a non-negative integer, got {prefetch!r}")
        if max_inflight_bytes is not None and (not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0):
            raise ValueError(f"offload: max_inflight_bytes must be a non-negative integer, got {max_inflight_bytes!r}")
        if optimizer_step not in OPTIMIZER_STEPS:
            raise ValueError(
                f"offload: optimizer_step must be one of {', '.join(OPTIMIZER_STEPS)}, got {optimizer_step!r}"
            )
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"offload: chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        _check_choice("grad_accumulation", grad_accumulation, GRADIENT_ACCUMULATIONS)
        _check_choice("update", update, UPDATES)
        _check_choice("delay_correction", delay_correction, DELAY_CORRECTIONS)
        if update != "after_backward" and optimizer_step != "host":
            raise ValueError(f"offload: update={update!r} steps the offloaded blocks on the host (optimizer_step host)")
        if delay_correction != "none" and update != "delayed":
            raise ValueError(f"offload: delay_correction={delay_correction!r} corrects update='delayed' only")
        if accumulation_dtype is not None and grad_accumulation != "device":
            raise ValueError("offload: accumulation_dtype is the dtype of grad_accumulation='device''s sums")
        if isinstance(host_threads, bool) or not isinstance(host_threads, int) or host_threads < 1:
            raise ValueError(f"offload: host_threads must be a positive integer, got {host_threads!r}")
        self.optimizer_step, self.chunk_bytes = optimizer_step, chunk_bytes
        self.grad_accumulation, self.accumulation_dtype = grad_accumulation, accumulation_dtype
        self.last_micro_batch, self.update, self.delay_correction = last_micro_batch, update, delay_correction
        self.host_threads = host_threads
        self.overlap_step = (overlap_step or update != "after_backward") and optimizer_step == "host"
        if layers == "auto" and budget_bytes is None and self.device.type == "cuda":
            budget_bytes = int(DEFAULT_BUDGET_FRACTION * torch.cuda.get_device_properties(self.device).total_memory)
        self.prefetch, self.compute_dtype = prefetch, compute_dtype
        self.layers = select_layers(
            model,
            layers,
            budget_bytes=budget_bytes,
            activation_bytes=activation_bytes,
            prefetch=prefetch,
            compute_dtype=compute_dtype,
            accumulation_dtype=(accumulation_dtype or torch.float32) if grad_accumulation == "device" else None,
        )
        self._order = execution_order(model)
        # Training schedule position of each block's last use (its lowest depth's backward): the device sums of
        # `grad_accumulation="device"` are final past it.
        schedule = self._order + self._order[::-1]
        self._last_position = {index: position for position, index in enumerate(schedule)}
        cuda = self.device.type == "cuda"
        # Two side streams so host-to-device prefetches and device-to-host gradients use both copy engines.
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._d2h = torch.cuda.Stream(self.device) if cuda else None

        self._blocks: dict[int, Block] = {}
        self._moved: list[tuple[nn.Parameter, torch.device]] = []
        self._moved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._place(cuda, materialize)
        self._stale = False  # an optimizer stepped since the compute-dtype copies were made
        self._handles = self._install()

        self._window = False  # between a forward's start and the end of its backward: p.data is the device tensor
        self._training = False
        self._backward = False
        self._finish_queued = False
        self._pos = 0
        self._schedule: list[int] = []
        self._bpos: int | None = None  # schedule position of the backward running now
        self._recomputed = False  # a recomputation at `_bpos` has run (see `_recompute_position`)
        self._freed: torch.Event | None = None  # CUDA: compute stream point after the last released block's use
        self._warned_autocast = False
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # CPU gradients accumulated before this backward
        # The gradient path: each gradient copied into its staging buffer on the side stream (CUDA), then added to its
        # CPU gradient by one worker thread while the backward goes on. `_pending`: the worker's task per parameter
        # (its staging buffer is busy until it is done); `_inflight`: copies not yet known to be done, with their bytes
        # (device gradients are kept alive until then: the backward waits only when they exceed `max_inflight_bytes`).
        self._worker = ThreadPoolExecutor(max_workers=host_threads, thread_name_prefix="hf-p2r-offload")
        self._pending: dict[nn.Parameter, Future] = {}
        self._inflight: deque[tuple[torch.Event, int]] = deque()
        self._inflight_bytes = 0
        largest = max((sum(w.numel() * w.element_size() for w in b.works) for b in self._blocks.values()), default=0)
        self.max_inflight_bytes = largest if max_inflight_bytes is None else max_inflight_bytes
        # Gradient norms (see `clip_grad_norm_`): this backward's, per parameter, as the worker leaves them; then, for
        # the `.grad` they describe, (norm, that gradient, its version counter when measured).
        self._part_norms: dict[nn.Parameter, torch.Tensor] = {}
        self._norms: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # `overlap_step`: each offloaded block's optimizer step, on the worker, until its next fetch waits for it; the
        # ids of the optimizers stepping them (their steps leave `_stale` alone); a clip's scale left to those steps.
        self._steps: dict[int, Future] = {}
        self._views: set[int] = set()
        self._clip: tuple[torch.Tensor, dict] | None = None
        self._overlapping = False  # the last optimizer `build_optimizer` made steps blocks on the worker
        self._chunking = False  # ... or steps them on the device in chunks
        self._optimizer = lambda: None  # (a weak reference to) that optimizer
        self._group_of: dict[nn.Parameter, dict] = {}  # its group of each offloaded parameter
        # `grad_accumulation="device"`: each offloaded parameter's sum of this step's micro-batches, on the device;
        # whether the backward running sends the step's gradients (`last_micro_batch`).
        self._accumulated: dict[nn.Parameter, torch.Tensor] = {}
        self._sending = True
        self._newest = False  # `delayed`: this forward (without grad) reads the masters
        # `update="during_backward"`: the blocks this step's backward has stepped, and the gradient tasks of each
        # block's parameters so far; `delay_correction="error_feedback"`: each master's last update, d(t-1).
        self._early: set[int] = set()
        self._landed_tasks: dict[int, dict[nn.Parameter, Future]] = {}
        self._previous_updates: dict[torch.Tensor, torch.Tensor] = {}
        # Bytes copied so far, for benchmarks and tests: weights to the device, gradients to the host.
        self.copied_bytes = {"to_device": 0, "to_host": 0}

    # ----------------------------------------------------------------------------------------------- install/remove

    def _install(self) -> list:
        handles = self._install_fetch_hooks() + self._install_gradient_hooks()
        if self.overlap_step:  # what reads or writes every weight waits for the steps still running (`delayed`: drains)
            handles.append(self.model.register_state_dict_pre_hook(lambda *args: self.synchronize()))
            handles.append(self.model.register_load_state_dict_pre_hook(lambda *args: self.synchronize()))
        if any(source is not master for b in self._blocks.values() for source, master in zip(b.sources, b.masters)):
            handles.append(register_optimizer_step_post_hook(self._stepped))
        return handles

    def remove(self) -> None:
        """Remove every hook and put every parameter and buffer back on the device it came from (same objects): a
        gradient still on its way (summed on the device, or with the worker) becomes its parameter's `.grad`."""
        self.synchronize()
        self._end()
        self._flush_gradients()
        self.synchronize()
        for p, (_, staging) in self._host.items():  # a `.grad` that is a staging buffer leaves the slab with it
            if p.grad is not None and p.grad.data_ptr() == staging.data_ptr():
                p.grad = p.grad.clone()
        self._worker.shutdown()
        for handle in self._handles:
            handle.remove()
        self._handles, self._host, self._norms, self._where = [], {}, {}, {}
        self._unplace()

    @property
    def offloaded_parameters(self) -> list[nn.Parameter]:
        return [p for block in self._blocks.values() for p in block.params]


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"offload: {name} must be one of {', '.join(choices)}, got {value!r}")
