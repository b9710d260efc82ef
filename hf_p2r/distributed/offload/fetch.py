"""The fetch hooks of granular offload: the forward and backward window in which an offloaded parameter's `.data` is
a device tensor whose storage exists only while its block runs. Each block is copied in `prefetch` positions ahead
of its use in execution order (forward, then backward, recomputations included; a side stream on CUDA), made ready
for the compute stream just before it runs, and released after."""

import warnings
from functools import partial

import torch
from torch import nn
from torch.profiler import record_function

from ...compat import in_backward, tensor_version
from .estimates import decoder_layers
from .placement import Block, alloc, free

__all__ = ["FetchHooks", "grad_tensor"]


def grad_tensor(output) -> torch.Tensor | None:
    """The first tensor in a block's output that autograd will send a gradient to."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else ()
    return next((t for t in map(grad_tensor, values) if t is not None), None)


class FetchHooks:
    """`GranularOffload`'s copies to the device and its module hooks (`_install` registers them)."""

    def _install_fetch_hooks(self) -> list:
        handles = [
            self.model.register_forward_pre_hook(self._begin),
            self.model.register_forward_hook(self._after_forward, always_call=True),
        ]
        for i, block in enumerate(decoder_layers(self.model)):
            handles.append(block.register_forward_pre_hook(partial(self._pre_forward, i)))
            handles.append(block.register_forward_hook(partial(self._post_forward, i)))
        return handles

    # ------------------------------------------------------------------------------------------- copies and memory

    def _fetch(self, block: Block) -> None:
        """Allocate the block's device tensors and start copying the masters in (on the side stream when CUDA)."""
        if block.fetched:
            return
        if self.update != "delayed":  # its update is done first (`delayed` sends the copies of the one before)
            with record_function("offload.wait_step"):
                self._wait_for_step(block.index)
        block.fetched = True
        # `delayed`: a forward without grad (an evaluation) reads the newest weights, the masters.
        sources = block.masters if self._newest else block.sources
        self.copied_bytes["to_device"] += sum(s.numel() * s.element_size() for s in sources)
        with record_function("offload.fetch"):
            if self._h2d is None:
                for work, source in zip(block.works, sources):
                    alloc(work)
                    work.copy_(source)
                return
            with torch.cuda.stream(self._h2d):
                # Device memory stays bounded by `prefetch + 1` blocks however far the CPU runs ahead of the GPU. The
                # copies are allocated on this side stream and `_release` frees them without `record_stream`, so the
                # caching allocator hands a released block's memory straight to the next allocation on this stream.
                # That is safe because this stream first waits for the compute stream's last use of every released
                # block (the event `_release` recorded): a copy into reused memory starts only after the kernels
                # reading it are done. (With `record_stream` the allocator reuses memory only once the GPU has passed
                # the recorded point, as seen from the CPU at allocation time; a CPU running ahead then gets fresh
                # memory for every fetch and the cache grows until an out-of-memory retry stalls it. FSDP2 orders its
                # all-gather buffers the same way.)
                if self._freed is not None:
                    self._h2d.wait_event(self._freed)
                for work, source in zip(block.works, sources):
                    alloc(work)
                    work.copy_(source, non_blocking=True)  # same dtype, pinned: an asynchronous memcpy
                block.event = self._h2d.record_event()

    def _ready(self, block: Block) -> None:
        """Make the compute stream wait for the block's copy before it uses the weights."""
        self._fetch(block)
        if block.ready:
            return
        block.ready = True
        if block.event is not None:
            torch.cuda.current_stream(self.device).wait_event(block.event)

    def _release(self, block: Block) -> None:
        for work in block.works:
            free(work)
        block.fetched = block.ready = False
        block.event = None
        if self._h2d is not None:  # the next fetch waits for this point of the compute stream (see `_fetch`)
            self._freed = torch.cuda.current_stream(self.device).record_event()

    def _advance(self, pos: int | None, current: int) -> None:
        """Block `current` is about to run at schedule position `pos`: keep/fetch the offloaded blocks of positions
        pos..pos+prefetch, release the others, and make `current` ready."""
        needed = [current] if current in self._blocks else []
        if pos is not None:
            needed += [i for i in self._schedule[pos : pos + self.prefetch + 1] if i in self._blocks]
        for block in self._blocks.values():
            if block.fetched and block.index not in needed:
                self._release(block)
        for index in dict.fromkeys(needed):
            self._fetch(self._blocks[index])
        if current in self._blocks:
            self._ready(self._blocks[current])

    # ------------------------------------------------------------------------------------------------------- hooks

    def _begin(self, module: nn.Module, args) -> None:
        self._end()  # a forward whose backward never ran (evaluation with grad enabled, an exception)
        self._window, self._backward, self._finish_queued, self._pos = True, False, False, 0
        self._bpos, self._recomputed = None, False
        self._training = torch.is_grad_enabled()
        # `delayed`: an evaluation sees the weights of every update made, the one running included (the training
        # rule is unchanged: the next training step still sends the copies of before it).
        self._newest = self.update == "delayed" and not self._training
        if self._newest:
            for index in list(self._steps):
                self._wait_for_step(index)
        self._schedule = self._order + self._order[::-1] if self._training else list(self._order)
        self._check_autocast()
        self._begin_step_bookkeeping()
        for block in self._blocks.values():
            for i, (p, master, work, source) in enumerate(zip(block.params, block.masters, block.works, block.sources)):
                if p.data_ptr() != master.data_ptr():
                    self._window = False
                    raise RuntimeError(
                        "offload: an offloaded parameter was moved or replaced while GranularOffload is applied "
                        "(model.to(), .half(), ...); call offload.remove() first and apply it again after"
                    )
                # Its step refreshes its copies (`_step_block`; `delayed`: swapped in at the next step).
                stepping = block.index in self._steps or block.swap_pending
                if source is not master and not stepping and (self._stale or block.versions[i] != tensor_version(p)):
                    if self._h2d is not None:
                        self._h2d.synchronize()  # (rare: weights written between steps) no copy still reads it
                    source.copy_(master)
                    block.versions[i] = tensor_version(p)
                if p.grad is not None:  # accumulated on the CPU; this backward's gradient is added to it
                    staged = p.grad.data_ptr() == block.staging[i].data_ptr()  # (`grad_accumulation="device"`)
                    self._grads[p] = p.grad.clone() if staged else p.grad
                    p.grad = None
                self._norms.pop(p, None)
                p.data = work
        self._stale = False
        for index in dict.fromkeys(self._schedule[: self.prefetch]):
            if index in self._blocks:
                self._fetch(self._blocks[index])

    def _check_autocast(self) -> None:
        """Warn once when autocast would cast offloaded weights: it caches each cast (and autograd saves it) until
        the autocast region ends, so the weights' memory would not be freed between their uses."""
        device_type = self.device.type
        if self._warned_autocast or not self._blocks or not torch.is_autocast_enabled(device_type):
            return
        dtype = torch.get_autocast_dtype(device_type)
        if any(work.dtype != dtype for block in self._blocks.values() for work in block.works):
            self._warned_autocast = True
            runs_in = self.compute_dtype or "their parameters' dtype"
            warnings.warn(
                f"offload: {device_type} autocast to {dtype} is on, but the offloaded blocks run in {runs_in}: "
                f"autocast keeps a {dtype} copy of every offloaded weight from forward to backward, so offload frees "
                f"no weight memory; pass compute_dtype={dtype}",
                stacklevel=2,
            )

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if output is None or not self._training:  # an exception, or no backward will follow
            self._end()

    def _pre_forward(self, index: int, module: nn.Module, args) -> None:
        if not self._window:
            if index in self._blocks:
                raise RuntimeError("offload: an offloaded block was called outside the model's forward")
            return
        if in_backward():  # recomputation in backward (checkpoint around the block)
            self._enter_backward(index, self._recompute_position(index))
            self._recomputed = True
            return
        self._pos += 1
        self._advance(self._pos - 1, index)

    def _recompute_position(self, index: int) -> int | None:
        """Backward position of a recomputation of block `index` that runs the block's hooks (a checkpoint applied
        around the block after offload). Non-reentrant: the block's output gradient hook has just announced the
        position (`_pre_backward`), and this is its recomputation. Reentrant: the forward ran without grad and left no
        hook, and depths are recomputed in backward order, so it is the next position. None if the schedule says
        otherwise (then only this block is fetched)."""
        pos = self._bpos if self._bpos is not None else len(self._order) - 1
        if self._bpos is None or self._recomputed:
            pos += 1
        return pos if pos < len(self._schedule) and self._schedule[pos] == index else None

    def _post_forward(self, index: int, module: nn.Module, args, output) -> None:
        if not self._window or not self._training or in_backward():
            return
        if (tensor := grad_tensor(output)) is not None:
            # Fires when the gradient of this depth's output is complete, i.e. right before its backward.
            tensor.register_hook(partial(self._pre_backward, index, 2 * len(self._order) - self._pos))

    def _pre_backward(self, index: int, pos: int, grad: torch.Tensor) -> None:
        self._enter_backward(index, pos)
        self._recomputed = False

    def _enter_backward(self, index: int, pos: int | None) -> None:
        if not self._window:
            raise RuntimeError(
                "offload: a backward ran after its forward's window closed: run each training forward's backward "
                "before the next forward, and only once (retain_graph=True backward twice is not supported)"
            )
        self._queue_finish()  # from the outermost backward: a reentrant checkpoint's inner backward ends earlier
        self._backward = True
        if pos is not None and pos != self._bpos:
            self._bpos = pos
        self._advance(pos, index)

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            # Runs when the whole backward (the outermost graph task) is done.
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """Close the window: device copies released, `p.data` back to the masters; after a sending backward (the
        step's last micro-batch, see `last_micro_batch`; every backward without it) the gradients into the CPU
        `.grad`. A backward that sends nothing waits for nothing (its gradients stay on the device or with the
        worker), so the micro-batches of a step run without a synchronisation between them."""
        if not self._window:
            return
        self._window = False
        sending = self._training and self._sending
        if sending:
            if self._backward:
                self._send_accumulated()
            if self._h2d is not None:  # a prefetch still reading a master must finish before the optimizer writes it
                with record_function("offload.wait_fetches"):
                    self._h2d.synchronize()
            self._finish_gradients()
        for block in self._blocks.values():
            self._release(block)
            for p, master in zip(block.params, block.masters):
                p.data = master
                if sending and block.index not in self._early:  # (an early step took its gradients)
                    self._hand_over_gradient(p)
