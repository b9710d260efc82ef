"""The gradient path of granular offload: each offloaded parameter's gradient leaves the device as soon as autograd
has accumulated it (a post-accumulate-grad hook), its norm taken where it is; it is copied into the parameter's
staging buffer (CUDA: on a side stream, the backward waiting only beyond `max_inflight_bytes` in flight) and a worker
thread adds it to the parameter's CPU gradient while the backward goes on. `clip_grad_norm_` then needs no pass over
the offloaded gradients to measure them."""

from collections.abc import Iterable

import torch
from torch import nn
from torch.profiler import record_function

from ...compat import tensor_version

__all__ = ["GradientPath"]


class GradientPath:
    """`GranularOffload`'s gradients: `_grad_ready` (the hook; with `grad_accumulation="device"` the device sums),
    `_send` (the copy to the host), `_collect` (the worker), `_finish_gradients` and `_hand_over_gradient` (at the
    end of a backward), `clip_grad_norm_`."""

    def _install_gradient_hooks(self) -> list:
        return [p.register_post_accumulate_grad_hook(self._grad_ready) for b in self._blocks.values() for p in b.params]

    def _bound_inflight(self, event: torch.Event, nbytes: int) -> None:
        """CUDA: count a gradient copy in flight; wait (on the CPU) for the oldest ones only while more than
        `max_inflight_bytes` are. Gradients are freed with `record_stream` (autograd allocates them on the compute
        stream), so their memory is reused only after their copy: without a bound a CPU running ahead of the GPU would
        keep every block's gradients allocated. Below it the backward never waits for a copy."""
        self._inflight.append((event, nbytes))
        self._inflight_bytes += nbytes
        while self._inflight and (self._inflight_bytes > self.max_inflight_bytes or self._inflight[0][0].query()):
            done, size = self._inflight.popleft()
            done.synchronize()
            self._inflight_bytes -= size

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Autograd has accumulated `p`'s gradient: once per backward after its last use, or with reentrant
        checkpointing once per inner backward that uses it. With `grad_accumulation="host"` it is sent now (`_send`).
        With "device" it is added to `p`'s buffer on the device, and the sum is sent only by the step's last
        micro-batch (`last_micro_batch`), once the block's last use in that backward is behind (`_final`; what is left
        is sent at the end of the backward)."""
        self._queue_finish()
        grad, p.grad = p.grad, None
        if self.grad_accumulation == "device":
            with record_function("offload.accumulate_on_device"):
                held = self._accumulated.pop(p, None)
                if held is not None:
                    grad = held.add_(grad)  # type promotion: the same sums as the host's, bit for bit
                elif grad.dtype != self._accumulation_dtype(p):
                    grad = grad.to(self._accumulation_dtype(p))
            if not (self._sending and self._final(p)):
                self._accumulated[p] = grad
                return
        self._send(p, grad)

    def _accumulation_dtype(self, p: nn.Parameter) -> torch.dtype:
        return self._host[p][1].dtype  # the staging buffer's (`accumulation_dtype`, default the master's)

    def _final(self, p: nn.Parameter) -> bool:
        """Whether the backward running now is past the last use of `p`'s block (its lowest depth)."""
        return self._bpos is not None and self._bpos >= self._last_position.get(self._where[p][0].index, 0)

    def _send_accumulated(self) -> None:
        """The end of a sending backward: the device sums whose last part `_final` did not recognise are sent now."""
        while self._accumulated:
            p, grad = self._accumulated.popitem()
            self._send(p, grad)

    def _send(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Copy a gradient (a part, or a step's device sum) into `p`'s staging buffer (CUDA: on the side stream) and
        have the worker add it to `p`'s CPU gradient while the backward goes on. Its norm is taken where it is (the
        compute device) when it is the first part of `p`'s gradient."""
        with record_function("offload.wait_staging"):
            if (earlier := self._pending.pop(p, None)) is not None:  # the staging buffer still holds an earlier part
                earlier.result()
            if self.grad_accumulation == "device":  # the staging buffer may be the `.grad` its last step still reads
                self._wait_for_step(self._where[p][0].index)
        master, host = self._host[p]
        nbytes = grad.numel() * grad.element_size()
        self.copied_bytes["to_host"] += nbytes
        # The norm of what `.grad` will hold (in the master's dtype); of a sum of parts the worker takes it instead.
        norm = None if p in self._grads else torch.linalg.vector_norm(grad, dtype=master.dtype)
        event = None
        with record_function("offload.gradient_copy"):
            if self._d2h is None:
                host.copy_(grad)
            else:
                self._d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h):
                    host.copy_(grad, non_blocking=True)
                    grad.record_stream(self._d2h)  # freed on the compute stream now, reused only after the copy
                    event = self._d2h.record_event()
                self._bound_inflight(event, nbytes)
        task = self._worker.submit(self._collect, p, event, norm)
        self._pending[p] = task
        if self.update == "during_backward" and self._sending and self._final(p):  # its last part of the step
            self._landed(p, task)

    def _collect(self, p: nn.Parameter, event: torch.Event | None, norm: torch.Tensor | None) -> None:
        """The worker: once the copy into `p`'s staging buffer is done, add it to `p`'s CPU gradient in one pass: the
        first is copied out in the master's dtype (or, with `grad_accumulation="device"` in that dtype, handed over
        as it is: it is the step's one part), later ones are added with type promotion (the same float32 sums as
        adding a converted copy, bit for bit). `norm` is the first part's; a sum's norm is taken here, on the CPU but
        off the critical path (overlapping the rest of the backward)."""
        with record_function("offload.wait_gradient_copy"):
            if event is not None:
                event.synchronize()
        with record_function("offload.host_accumulate"):
            (master, host), total = self._host[p], self._grads.get(p)
            if total is None:
                handed = self.grad_accumulation == "device" and host.dtype == master.dtype
                self._grads[p] = host if handed else host.to(master.dtype, copy=True)
                self._part_norms[p] = norm
            else:
                self._part_norms[p] = torch.linalg.vector_norm(total.add_(host))

    def _finish_gradients(self) -> None:
        """End of a sending backward: every gradient collected by the worker."""
        with record_function("offload.wait_gradients"):
            pending, self._pending = self._pending, {}
            for task in pending.values():
                task.result()
        self._inflight.clear()
        self._inflight_bytes = 0

    def _flush_gradients(self) -> None:
        """Every gradient still on its way (device sums, the worker's parts) into its parameter's `.grad` (`remove`)."""
        self._send_accumulated()
        self._finish_gradients()
        for p in list(self._grads):
            self._hand_over_gradient(p)

    def _hand_over_gradient(self, p: nn.Parameter) -> None:
        """`p` is back on its master: its CPU gradient becomes its `.grad`, with the norm measured for it."""
        if (grad := self._grads.pop(p, None)) is not None:
            p.grad = grad
            if (norm := self._part_norms.pop(p, None)) is not None:
                self._norms[p] = (norm, grad, tensor_version(grad))

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` (2-norm) over `parameters`, without a pass over offloaded gradients to
        measure them: each offloaded gradient's norm was taken as it left the device (or, for a sum of several
        backwards' parts, by the worker that summed it, during the backward). A gradient changed since (its version
        counter moved: unscaled, clipped, zeroed) is measured again. The total is the 2-norm of the per-tensor norms in
        parameter order, as torch computes it, and the gradients are scaled by `clip_grads_with_norm_`, the offloaded
        ones by the next step of the optimizer `build_optimizer` made where it steps them on the worker or the device
        (`overlap_step`, "device_chunked"); on one device (the CPU) the result is torch's bit for bit. Returns the total
        norm, on the compute device.
        """
        if self._early:
            raise RuntimeError(
                "offload: update='during_backward' has already stepped the offloaded blocks "
                f"{sorted(self._early)} with their gradients, before the whole gradient's norm was known: clip "
                "nothing with it (max_grad_norm 0), or use update='after_backward' or 'delayed'"
            )
        params = [p for p in parameters if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        norms = []
        for p in params:
            norm, grad, version = self._norms.get(p, (None, None, None))
            if grad is not p.grad or version != tensor_version(p.grad):
                norm = torch.linalg.vector_norm(p.grad)
            norms.append(norm.to(self.device, non_blocking=True))
        total = torch.linalg.vector_norm(torch.stack(norms))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"offload: the total norm of the gradients is {total.item()}")
        if not (self._overlapping or self._chunking):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            return total
        # Offloaded gradients are scaled by the next step of the optimizer `build_optimizer` made, off the critical
        # path (`step_overlapped`: on the worker; `step_in_chunks`: on the device): the same factor as
        # `clip_grads_with_norm_`'s, for the gradients as they are now (a gradient changed before the step is left as
        # it is then); that step consumes them (their `.grad` is None after it).
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p not in self._host], max_norm, total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clip = coef, {p: (id(p.grad), tensor_version(p.grad)) for p in params if p in self._host}
        return total
