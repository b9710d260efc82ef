"""The optimizer step of granular offload's parameters: `build_optimizer` makes one optimizer over the model whose
groups are split into a resident part (stepped on the compute device) and an offloaded part, stepped on the CPU
(`optimizer_step="host"`; with `overlap_step`, block by block on the worker thread while the next forward runs, each
block's fetch waiting for its own step) or on the compute device a bounded chunk at a time, the state kept in pinned
host memory (`optimizer_step="device_chunked"`, Megatron-Core's chunked optimizer-state offload)."""

import copy
import types
import weakref
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future

import torch
from torch import nn
from torch.profiler import record_function

from ...compat import tensor_version
from ..delay import feed_back_error_
from .placement import Block, slab

__all__ = ["DEFAULT_CHUNK_BYTES", "OPTIMIZER_STEPS", "UPDATES", "OptimizerStep"]

# Where the offloaded parameters' optimizer step runs (`GranularOffload(optimizer_step=...)`): "host", on the CPU over
# the CPU masters and CPU optimizer state (ZeRO-Offload's cut); "device_chunked", on the compute device, a chunk of
# parameters at a time: each chunk's masters, gradients and optimizer state are copied in, stepped, copied back
# (Megatron-Core's chunked optimizer-state offload; the state lives in pinned host memory).
OPTIMIZER_STEPS = ("host", "device_chunked")
# The bound on one chunk of "device_chunked": its parameters, their gradients and their optimizer state, in bytes.
DEFAULT_CHUNK_BYTES = 256 * 2**20
# When a "host" step updates the offloaded blocks (`GranularOffload(update=...)`):
# - "after_backward": once `optimizer.step()` is called, block by block on the worker while the next forward runs,
#   each block's next fetch waiting for its own update (with `overlap_step`; at once without it);
# - "during_backward": each block as soon as its gradient of the step's last micro-batch has reached the host, while
#   the rest of the backward runs (exact, but no clip can scale gradients already used: no `clip_grad_norm_`);
# - "delayed": ZeRO-Offload's delayed parameter update: step t's update runs on the worker during step t+1, whose
#   forward and backward send the weights of the update before (one step stale: W(t+1) = W(t) - u(grad f_t(W(t-1)))),
#   optionally corrected as PipeDream-2BW's delay is (`delay_correction="error_feedback"`).
UPDATES = ("after_backward", "during_backward", "delayed")


class OptimizerStep:
    """`GranularOffload`'s optimizer: `build_optimizer`, the overlapped host step (`step_overlapped`, `_step_block`
    on the worker), the chunked device step (`step_in_chunks`), and `synchronize`."""

    def _stepped(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if id(optimizer) not in self._views:  # a block's step refreshes its own copies
            self._stale = True

    def synchronize(self) -> None:
        """Wait for the offloaded blocks' optimizer steps still running (`overlap_step`, `update`). A block's next
        fetch, the model's and the optimizer's `state_dict`/`load_state_dict`, the next step and `remove` wait by
        themselves; call it before reading offloaded weights or optimizer state otherwise. With `update="delayed"` it
        drains: the last update is applied and sent from the next step on (no staleness at that step, as after a
        resume from a checkpoint written here), and the delay correction starts afresh."""
        self._settle_updates(drain=True)

    def _settle_updates(self, drain: bool = False) -> None:
        """The updates a new step must see done: all of them (`after_backward`, a drain), those not started during
        this step's backward (`during_backward`); `delayed`: the last step's, whose copies to send are swapped in."""
        with record_function("offload.wait_steps"):
            for index in list(self._steps):
                if drain or index not in self._early:
                    self._wait_for_step(index)
        for block in self._blocks.values():
            if block.swap_pending:  # `delayed`: what its last update wrote is sent from now on
                block.sources, block.next_sources = block.next_sources, block.sources
                block.swap_pending = False
        if drain:
            self._previous_updates.clear()

    def _begin_step_bookkeeping(self) -> None:
        """A forward starts: whether its backward sends the step's gradients (`last_micro_batch`), and which blocks
        its backward has stepped (`during_backward`)."""
        self._sending = not self._training or self.last_micro_batch is None or bool(self.last_micro_batch())
        if self._sending:
            self._early, self._landed_tasks = set(), {}
        if self.update == "during_backward" and self._training and self._sending and self._optimizer() is None:
            self._window = False
            raise RuntimeError(
                "offload: update='during_backward' steps each block with the optimizer build_optimizer made: build "
                "it before the first training forward"
            )

    def _wait_for_step(self, index: int) -> None:
        """Block `index`'s optimizer step still running on the worker, if any, done."""
        if (step := self._steps.pop(index, None)) is not None:
            step.result()

    def build_optimizer(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict] | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **kwargs,
    ) -> torch.optim.Optimizer:
        """A plain `optimizer_cls` over `params` (default: all of the model's) whose step runs on each parameter's
        device: resident parameters on the compute device, offloaded ones on the CPU (`optimizer_step="host"`) or, with
        `optimizer_step="device_chunked"`, on the compute device a chunk at a time (`step_in_chunks`).

        Each parameter group is split into its resident and its offloaded part (same options), resident parts first:
        torch optimizers step group by group, so the device kernels are all launched (asynchronously) before the CPU
        part starts, and the two overlap. The update is elementwise, so it equals one `optimizer_cls` over the
        unsplit groups. State stays addressable per parameter (`optimizer.state[p]`); note that `state_dict()` has
        the split groups. AdamW defaults to `fused=True` (torch's fused CPU AdamW is the fast CPU path).
        """
        groups = list(self.model.parameters() if params is None else params)
        if not groups:
            raise ValueError("offload: build_optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        offloaded = {id(p) for p in self.offloaded_parameters}
        resident, host = [], []
        for group in groups:
            group_params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            options = {key: value for key, value in group.items() if key != "params"}
            for part, keep in ((resident, False), (host, True)):
                if chosen := [p for p in group_params if (id(p) in offloaded) == keep]:
                    part.append({**options, "params": chosen})
        if issubclass(optimizer_cls, torch.optim.AdamW) and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused"] = True
        optimizer = optimizer_cls(resident + host, **kwargs)
        # `overlap_step` steps blocks through shallow copies of the optimizer: for torch's own classes, whose step
        # reads only `param_groups` and `state`; another class (one with inner optimizers) steps its offloaded part
        # at once, on the CPU, as without `overlap_step`.
        self._overlapping = self.overlap_step and optimizer_cls.__module__.startswith("torch.optim.")
        if self.update != "after_backward" and not self._overlapping:
            raise ValueError(
                f"offload: update={self.update!r} steps blocks through views of a torch.optim optimizer; "
                f"{optimizer_cls.__name__} is not one (use update='after_backward')"
            )
        self._optimizer = weakref.ref(optimizer)
        self._group_of = {p: group for group in optimizer.param_groups for p in group["params"] if p in self._host}
        if self._overlapping:
            step = optimizer.step

            def step_overlapped(optimizer: torch.optim.Optimizer, closure=None):
                return self.step_overlapped(optimizer, step, closure)

            optimizer.step = types.MethodType(step_overlapped, optimizer)
            optimizer.register_state_dict_pre_hook(lambda *args: self.synchronize())
            optimizer.register_load_state_dict_pre_hook(lambda *args: self.synchronize())
        self._chunking = self.optimizer_step == "device_chunked"
        if self._chunking:
            step = optimizer.step  # the class's step (with torch's step hooks), bound to this optimizer

            def step_in_chunks(optimizer: torch.optim.Optimizer, closure=None):
                return self.step_in_chunks(optimizer, step, closure)

            optimizer.step = types.MethodType(step_in_chunks, optimizer)  # a method still: LR schedulers wrap it
        return optimizer

    def _offloaded_gradients(self, optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
        """The offloaded parameters `optimizer` steps that have a gradient, each with its group, and their gradients."""
        if self._accumulated:
            raise RuntimeError(
                f"offload: the optimizer steps while the gradients of {len(self._accumulated)} offloaded parameters "
                "are still summed on the device: the last backward was not the step's last micro-batch "
                "(last_micro_batch said so)"
            )
        offloaded = [
            (p, group)
            for group in optimizer.param_groups
            for p in group["params"]
            if p in self._host and p.grad is not None
        ]
        return offloaded, {p: p.grad for p, _ in offloaded}

    def step_overlapped(self, optimizer: torch.optim.Optimizer, step, closure=None):
        """`overlap_step`: `step` (the optimizer's own) over the resident parameters now, then each offloaded block's
        part on the worker thread, blocks in the order the next forward needs them; returns without waiting for them.
        Each block's next fetch waits for its step, so the CPU updates overlap the device's work that does not need
        them (the rest of the step, the next forward up to that block).

        A block is stepped by a shallow copy of the optimizer (`copy.copy`: its own empty hooks, no patched `step`)
        whose groups hold the block's CPU masters (with the group's current options) and whose state maps each master
        to its parameter's state dict, filled in place: the same update as one call for any optimizer whose update of
        a parameter reads only that parameter, its gradient, its state and its group (every torch optimizer). The
        offloaded gradients are handed to these steps: after `step` the offloaded parameters' `.grad` is None. A clip
        by `clip_grad_norm_` just before scales them there too (once its device-side factor is known, on the worker).
        """
        self._settle_updates()
        offloaded, grads = self._offloaded_gradients(optimizer)
        for p in grads:
            p.grad = None
        stale = self._stale
        try:
            loss = step(closure)  # the resident parameters, on the compute device
        except BaseException:
            for p, grad in grads.items():
                p.grad = grad
            raise
        self._stale = stale
        coef, clipped = self._clip if self._clip is not None else (None, {})
        self._clip = None
        if coef is not None and self._h2d is not None:  # CUDA: the worker reads it once the compute stream made it
            coef = (coef, torch.cuda.current_stream(self.device).record_event())
        parts: dict[int, dict[int, tuple[dict, list]]] = {}  # block index -> {id(group): (group, [(p, master)])}
        for p, group in offloaded:
            block, i = self._where[p]
            block.masters[i].grad = grads[p]
            parts.setdefault(block.index, {}).setdefault(id(group), (group, []))[1].append((p, block.masters[i]))
        for index in dict.fromkeys(self._order):
            if index not in parts:
                continue
            view = self._view(optimizer, parts[index])
            pairs = [pair for _, pairs in parts[index].values() for pair in pairs]
            scaled = [master.grad for p, master in pairs if clipped.get(p) == (id(grads[p]), tensor_version(grads[p]))]
            self._submit_step(self._blocks[index], view, scaled, coef)
        return loss

    def _view(self, optimizer: torch.optim.Optimizer, parts: dict) -> torch.optim.Optimizer:
        """A shallow copy of `optimizer` stepping the masters of `parts` ({id(group): (group, [(p, master)])}, each
        master with its `.grad`): its groups hold the masters with each group's current options, its state maps each
        master to its parameter's state dict (filled in place)."""
        view = copy.copy(optimizer)
        view.param_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [m for _, m in pairs]}
            for group, pairs in parts.values()
        ]
        pairs = [pair for _, pairs in parts.values() for pair in pairs]
        view.state = defaultdict(dict, {master: optimizer.state[p] for p, master in pairs})
        self._views.add(id(view))
        return view

    def _submit_step(self, block: Block, view: torch.optim.Optimizer, scaled: list, coef) -> None:
        self._steps[block.index] = self._worker.submit(self._step_block, block, view, scaled, coef)
        block.swap_pending = self.update == "delayed"

    def _landed(self, p: nn.Parameter, task: Future) -> None:
        """`during_backward`: `p`'s gradient of the step's last micro-batch is on its way to the host (`task`); once
        its whole block's are, the block is stepped on the worker, after them, while the backward goes on."""
        block = self._where[p][0]
        tasks = self._landed_tasks.setdefault(block.index, {})
        tasks[p] = task
        if len(tasks) == len(block.params) and all(q in self._group_of for q in block.params):
            self._early.add(block.index)
            self._steps[block.index] = self._worker.submit(self._step_early, block, list(tasks.values()))

    def _step_early(self, block: Block, tasks: list[Future]) -> None:
        """The worker: a block's update as soon as its gradients have landed (`during_backward`)."""
        for task in tasks:
            task.result()
        parts: dict[int, tuple[dict, list]] = {}
        for p, master in zip(block.params, block.masters):
            master.grad = self._grads.pop(p)
            self._part_norms.pop(p, None)
            group = self._group_of[p]
            parts.setdefault(id(group), (group, []))[1].append((p, master))
        self._step_block(block, self._view(self._optimizer(), parts), [], None)

    def _step_block(self, block: Block, view: torch.optim.Optimizer, scaled: list, coef) -> None:
        """The worker: a block's deferred clip and its optimizer step on the CPU, then its copies to send (`delayed`:
        the next step's, after the delay correction). `coef`: the clip's factor, with (CUDA) the event after which
        the compute stream has it."""
        delayed = self.update == "delayed"
        correct = delayed and self.delay_correction == "error_feedback"
        try:
            if scaled:
                if isinstance(coef, tuple):
                    coef, made = coef
                    with record_function("offload.wait_clip"):
                        made.synchronize()  # waits for the norm on the device, here rather than in the step
                factor = coef.to("cpu")
                for grad in scaled:
                    grad.mul_(factor)  # as clip_grads_with_norm_ scales them
            stepped = [master for group in view.param_groups for master in group["params"]]
            before = [master.clone() for master in stepped] if correct else []
            with record_function("offload.host_step"):
                type(view).step(view)
            for master, old in zip(stepped, before):
                self._previous_updates[master] = feed_back_error_(master, old, self._previous_updates.get(master))
        finally:
            for group in view.param_groups:
                for master in group["params"]:
                    master.grad = None
            self._views.discard(id(view))
        targets = block.next_sources if delayed else block.sources
        with record_function("offload.refresh_copies"):
            for i, (p, master, source) in enumerate(zip(block.params, block.masters, targets)):
                if source is not master:
                    source.copy_(master)
                block.versions[i] = tensor_version(p)

    def step_in_chunks(self, optimizer: torch.optim.Optimizer, step, closure=None):
        """`optimizer_step="device_chunked"`: `step` (the optimizer's own) first over the resident parameters, then
        once per chunk of offloaded parameters with a gradient, each with its master, gradient and optimizer state
        copied to the compute device and back after. A chunk holds parameters in optimizer order up to `chunk_bytes`
        of parameters, gradients and state (a larger parameter is a chunk alone).

        Each call sees gradients on only the parameters it steps (the others' `.grad` are set aside, and every torch
        optimizer skips a parameter without one), so any optimizer class whose update of a parameter reads only that
        parameter, its gradient, its state and its group steps as it would in one call. The state returns to host
        memory (pinned on CUDA, one allocation per chunk), in the dtype and shape the optimizer made it; a `step`
        count stays where torch's `load_state_dict` keeps it (on the CPU unless the group is fused or capturable).
        With `compute_dtype`, the copies the next forward sends are cast on the device and copied back too. A clip by
        `clip_grad_norm_` just before scales the offloaded gradients here, on the device (then they are consumed: their
        `.grad` is None after the step; otherwise it is kept as after any step). Returns
        when the host has every result (CUDA: the compute stream is synchronised once, after the last chunk).
        """
        offloaded, grads = self._offloaded_gradients(optimizer)
        coef, clipped = self._clip if self._clip is not None else (None, {})
        self._clip = None  # a clip just before: its factor scales the offloaded gradients on the device, per chunk
        scaled = {p for p, grad in grads.items() if clipped.get(p) == (id(grad), tensor_version(grad))}
        stale = self._stale  # an optimizer stepped offloaded masters before this step (see `_stepped`)
        for p in grads:
            p.grad = None
        try:
            loss = step(closure)  # the resident parameters, on the compute device
            for group in optimizer.param_groups:  # each call after it steps one chunk of offloaded parameters
                for p in group["params"]:
                    if p.grad is not None:
                        grads[p], p.grad = p.grad, None
            chunk, size = [], 0
            for p, group in offloaded:
                tensors = sum(
                    isinstance(v, torch.Tensor) and v.numel() == p.numel() for v in optimizer.state.get(p, {}).values()
                )
                nbytes = p.numel() * p.element_size() * (2 + (tensors or 2))  # parameter, gradient, state (AdamW: 2)
                if chunk and size + nbytes > self.chunk_bytes:
                    self._step_chunk(optimizer, step, chunk, grads, scaled, coef)
                    chunk, size = [], 0
                chunk.append((p, group))
                size += nbytes
            if chunk:
                self._step_chunk(optimizer, step, chunk, grads, scaled, coef)
        finally:
            for p, grad in grads.items():
                p.grad = None if p in scaled else grad  # a clipped offloaded gradient was consumed unscaled
        if self._h2d is not None:
            torch.cuda.current_stream(self.device).synchronize()
        self._stale = stale  # every offloaded master stepped here has fresh copies to send
        return loss

    def _step_chunk(self, optimizer: torch.optim.Optimizer, step, chunk: list, grads: dict, scaled: set, coef) -> None:
        state, device, pin = optimizer.state, self.device, self._h2d is not None

        def stays(key: str, group: dict) -> bool:  # torch's `load_state_dict` policy for a step count
            return key == "step" and not (group.get("fused") or group.get("capturable"))

        moved = []
        try:
            for p, group in chunk:
                master, host_state = p.data, state.get(p, {})
                moved.append((p, group, master, host_state))
                p.data = master.to(device, copy=True, non_blocking=True)
                p.grad = grads[p].to(device, copy=True, non_blocking=True)
                if p in scaled:
                    p.grad.mul_(coef.to(device))  # as clip_grads_with_norm_ scales it
                if host_state:
                    state[p] = {
                        k: v.to(device, copy=True, non_blocking=True)
                        if isinstance(v, torch.Tensor) and not stays(k, group)
                        else v
                        for k, v in host_state.items()
                    }
            step()  # only this chunk's parameters have gradients
        finally:
            fresh = []  # (state dict, key, device tensor) needing new host memory
            for p, group, master, host_state in moved:
                master.copy_(p.data, non_blocking=True)
                block, i = self._where[p]
                if (source := block.sources[i]) is not master:  # the copy the next forward sends, cast here
                    source.copy_(p.data.to(source.dtype), non_blocking=True)
                returned = {}
                for k, v in state.get(p, {}).items():
                    if not isinstance(v, torch.Tensor) or stays(k, group) or v.device != device:
                        returned[k] = v
                    elif (
                        (old := host_state.get(k)) is not None
                        and (old.shape, old.dtype) == (v.shape, v.dtype)
                        and (old.is_pinned() or not pin)
                    ):
                        returned[k] = old.copy_(v, non_blocking=True)
                    else:
                        fresh.append((returned, k, v))
                if p in state:
                    state[p] = returned
                p.grad = None
                p.data = master
                block.versions[i] = tensor_version(p)
            if fresh:
                _, tensors = slab([(v.shape, v.dtype) for _, _, v in fresh], pin)
                for (returned, k, v), host in zip(fresh, tensors):
                    returned[k] = host.copy_(v, non_blocking=True)
