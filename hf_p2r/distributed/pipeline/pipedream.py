"""PipeDream-2BW (Narayanan et al., arXiv 2006.09503) as a schedule over torch's `PipelineStage`: 1F1B without
pipeline flushes, two weight versions per stage, one optimizer step every m >= d micro-batches.

The update rule is W(t+1) = W(t) - nu * grad f_t(W(t-1)): batch t's m micro-batches run forward and backward on the
weights of one step earlier, their gradients are summed (coalesced, scaled by 1/m: the mean over the micro-batches)
into one optimizer step applied to the newest weights; any optimizer (Adam included) sees grad f_t(W(t-1)) where plain
training would see grad f_t(W(t)). W(-1) = W(0).

How a stage keeps it exact with two versions. The micro-batches stream through the stage in 1F1B order across
optimizer steps (`step()` calls) with no flush: at stage s of d, w = d - s micro-batches are in flight, so `step(t)`
runs batch t's m forwards and the backwards of micro-batches tm - w ... tm + m - 1 - w (the tail of batch t-1 first).
Two sets of parameter tensors (A, B) alternate by batch parity: batch t runs on set t mod 2, installed in the stage's
module before its first forward, so its graphs hold set t mod 2 and its weight gradients accumulate there. At the end
of `step(t)` batch t-1 is complete on this stage (w <= m), so set (t-1) mod 2 is free: it takes the values of set
t mod 2 (W(t-1)), and the optimizer steps it with batch t-1's gradient (computed on W(t-2)): it now holds W(t), which
batch t+1 will run on, while batch t's in-flight micro-batches keep W(t-1) in the other set. Hence never more than two
versions of a weight (`live_versions` counts them from the autograd graphs), and the update needs no third copy: the
optimizer's state follows its parameter from one set to the other.

The delay correction (`delay_correction="error_feedback"`, the trainer's `pipeline_delay_correction`), after the
error-feedback idea of arXiv 2606.30634 (section 3, "Staleness Mitigation"), for any optimizer: let d(t) be the
update the optimizer makes at step t (W after its step minus W before, weight decay included) from the stale gradient
grad f_t(W(t-1)). The update applied at step t-1 was d(t-1), but the update computed one step later, d(t), is the
better estimate of what step t-1 should have applied (it saw one more step of the trajectory); their difference
e(t-1) = d(t) - d(t-1) is the error of the update applied, and it is fed back into the next one:

    W(t+1) = W(t) + d(t) + (d(t) - d(t-1)),     W(1) = W(0) + d(0)  (no update before the first: no error).

The corrections telescope (their sum up to t is d(t) - d(0)): the weights run one update ahead of the plain delayed
trajectory, W(t+1) = W(0) + d(0) + ... + d(t) + d(t) - d(0), which compensates the step the gradient lags behind. It
costs one weight-sized buffer per parameter (d(t-1), kept by the schedule beside the optimizer's state, in its
checkpoint, and copied to a block's copies at a delink: each copy received the shared block's last update), and one
subtraction and two additions per update. Caveat: the paper's section 3 formula was not available to this
implementation (only its abstract and summaries were); the rule is the one above, stated and tested here.

`drain()` finishes the in-flight micro-batches and applies the last batch's update, without changing the rule (the
next batch still runs on W(t-1)): call it before a checkpoint, a delink, the end of training, and before anything
else sends between the same processes (a gradient still on its way would be taken for that other message). Sends
are never waited for before `drain()` (a stage may send a gradient that its peer receives in the next `step()` call),
and the collectives of an update (replica reduction, gradient norm) run at the end of `step()`, where every stage is.
"""

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ...compat import initialize_pipeline_stage, pipeline_stage_stashed_graphs
from ..delay import DELAY_CORRECTIONS, feed_back_error_
from .schedules import get_schedule


class SchedulePipeDream2BW(PipelineScheduleSingle):
    """PipeDream-2BW over one `PipelineStage` per process.

    It owns its state (the two weight versions, which one the module holds, which one the optimizer steps, the batch
    counters); what it needs of the pipeline around it is passed in: `finish_gradients` is called with a version's
    parameters (stage names) once its batch's backwards are done (the mean over the micro-batches, the replicas'
    reduction and the clipping: `Pipeline.finish_gradients`), `optimizer` returns the optimizer to step, over the
    module's parameters when it was made (after a delink: the new one, after `delinked`).
    """

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable,
        *,
        finish_gradients: Callable[[dict[str, nn.Parameter]], None],
        optimizer: Callable[[], torch.optim.Optimizer],
        delay_correction: str = "none",
    ):
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        get_schedule("2bw").check_microbatches(n_microbatches, stage.num_stages)
        if delay_correction not in DELAY_CORRECTIONS:
            raise ValueError(
                f"pipeline_delay_correction: {delay_correction!r} is not one of {', '.join(DELAY_CORRECTIONS)}"
            )
        self.delay_correction = delay_correction
        self.previous_update: dict[str, torch.Tensor] = {}  # d(t-1) by stage name (error_feedback)
        self.m, self.stage, self.loss_fn = n_microbatches, stage, loss_fn
        self.finish_gradients, self._optimizer = finish_gradients, optimizer
        # Micro-batch g uses the stage's infrastructure slot g mod 2m (fewer than m are ever in flight).
        self.slots = 2 * n_microbatches
        self._ready = False
        self._warmup = stage.num_stages - stage.stage_index
        self._in_flight: deque[int] = deque()
        self._losses: dict[int, torch.Tensor] = {}  # until the micro-batch's backward
        self._loss_values: dict[int, torch.Tensor] = {}  # until `step` returns them
        self._sends: list[dist.Work] = []
        self.batches = 0  # batches started
        self.updated = 0  # batches whose update is applied
        self.observer: Callable[[], None] | None = None  # called after every forward and backward (tests)
        first = dict(stage.submod.named_parameters())
        self.versions = [first, _clone(first)]
        self.installed = 0  # the set the module holds
        self.optimizer_set = 0  # the set the optimizer's parameter slots point at

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer()
        if optimizer is None:
            raise ValueError(
                "pipeline_schedule: 2bw steps the optimizer itself; give the pipeline one (optimizer_factory)"
            )
        return optimizer

    # --- the schedule ---------------------------------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """Batch `self.batches`: its m forwards interleaved 1F1B with the backwards that are due, then the update of
        the previous batch. On the last stage `losses` receives this batch's m micro-batch losses. (Unlike torch's
        schedules, the stage's runtime state is not cleared: in-flight micro-batches carry over.)"""
        m = self.m
        if args or kwargs:
            args_split, kwargs_split = split_args_kwargs_into_chunks(args, kwargs, m)
        else:
            args_split, kwargs_split = [()] * m, [{}] * m
        targets = list(torch.tensor_split(target, m)) if target is not None else None
        self._step_microbatches(args_split, kwargs_split, targets, losses)

    def _step_microbatches(
        self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=False, loss_kwargs=None
    ):
        stage, m = self.stage, self.m
        stage.has_backward = True
        target_mbs = target_mbs if target_mbs is not None else [None] * m
        if not self._ready:
            initialize_pipeline_stage(self, self.slots, arg_mbs[0], kwarg_mbs[0], target_mbs[0])
            self._ready = True
            for param in stage.submod.parameters():
                param.grad = None  # metadata inference ran a backward
        batch = self.batches
        self._install(batch % 2)
        for index in range(m):
            if len(self._in_flight) >= self._warmup:
                self._backward(self._in_flight.popleft())
            self._forward(batch * m + index, arg_mbs[index], kwarg_mbs[index], target_mbs[index])
        self.batches += 1
        if losses is not None and stage.is_last:
            losses.clear()
            losses.extend(self._loss_values.pop(batch * m + index) for index in range(m))
        if batch >= 1 and self.updated < batch:
            self._update(batch - 1)

    def drain(self) -> None:
        """Run the in-flight backwards, wait for every send, apply the last batch's update (a flush that keeps the
        update rule)."""
        while self._in_flight:
            self._backward(self._in_flight.popleft())
        for work in self._sends:
            work.wait()
        self._sends.clear()
        if self.batches and self.updated < self.batches:
            if self.updated < self.batches - 1:
                self._update(self.batches - 2)
            self._update(self.batches - 1)

    def _slot(self, micro_batch: int) -> int:
        return micro_batch % self.slots

    def _forward(self, micro_batch: int, args, kwargs, target) -> None:
        stage, slot = self.stage, self._slot(micro_batch)
        for info in stage.args_recv_info[slot]:
            buffer = getattr(info, "buffer", None)  # a first stage's inputs: no buffer (torch 2.11: no attribute)
            if buffer is not None:
                buffer.grad = None  # the slot's previous micro-batch left its input gradient there
        _wait(stage.get_fwd_recv_ops(slot))
        output = stage.forward_one_chunk(slot, args, kwargs, save_forward_output=False)
        if stage.is_last:
            self._losses[micro_batch] = self.loss_fn(output, target)
            self._loss_values[micro_batch] = self._losses[micro_batch].detach()
        self._sends.extend(_start(stage.get_fwd_send_ops(slot)))
        self._in_flight.append(micro_batch)
        self._observe()

    def _backward(self, micro_batch: int) -> None:
        stage, slot = self.stage, self._slot(micro_batch)
        _wait(stage.get_bwd_recv_ops(slot))
        stage.backward_one_chunk(slot, loss=self._losses.pop(micro_batch, None), last_backward=False)
        self._sends.extend(_start(stage.get_bwd_send_ops(slot)))
        self._sends = [work for work in self._sends if not work.is_completed()]
        self._observe()

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer()

    # --- the versions ---------------------------------------------------------------------------------------------
    def _install(self, index: int) -> None:
        """Make set `index` the module's parameters (the next forwards run on it)."""
        module = self.stage.submod
        for name, param in self.versions[index].items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, param)
        self.installed = index

    def _update(self, batch: int) -> None:
        """W(batch + 1) = W(batch) - step(grad f_batch(W(batch - 1))), into the set batch ran on (now free)."""
        updated, newest = self.versions[batch % 2], self.versions[(batch + 1) % 2]
        self.finish_gradients(updated)  # the mean over the micro-batches, reduced (and clipped) as the pipeline does
        with torch.no_grad():
            for name, param in updated.items():
                param.copy_(newest[name])
        self._point_optimizer_at(batch % 2)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.delay_correction == "error_feedback":
            self._feed_back_error(updated, newest)
        self.updated = batch + 1

    def _feed_back_error(self, updated: dict[str, nn.Parameter], before: dict[str, nn.Parameter]) -> None:
        """Add e(t-1) = d(t) - d(t-1) to the update just applied, d(t) = updated - before (see the module docstring)."""
        for name, param in updated.items():
            self.previous_update[name] = feed_back_error_(param, before[name], self.previous_update.get(name))

    def _point_optimizer_at(self, index: int) -> None:
        """The optimizer steps set `index`: its parameter slots and per-parameter state move there."""
        if index == self.optimizer_set:
            return
        old, new = self.versions[self.optimizer_set], self.versions[index]
        swap = {id(old[name]): new[name] for name in old}
        for group in self.optimizer.param_groups:
            group["params"] = [swap[id(param)] for param in group["params"]]
        for name in old:
            if old[name] in self.optimizer.state:
                self.optimizer.state[new[name]] = self.optimizer.state.pop(old[name])
        self.optimizer_set = index

    def current_weights(self) -> dict[str, torch.Tensor]:
        """The newest weights W(updated) after `drain()` (stage names)."""
        return {name: param.detach() for name, param in self.versions[(self.updated - 1) % 2].items()}

    def live_versions(self) -> int:
        """The most versions of one weight alive now: distinct tensors per weight among the installed parameters,
        the two sets, the optimizer's parameters and every parameter the in-flight micro-batches' autograd graphs
        reach (counted per shape and position, so a leaked copy anywhere on those paths shows)."""
        tensors: set[int] = set()
        tensors.update(id(param) for param in self.stage.submod.parameters())
        for version in self.versions:
            tensors.update(id(param) for param in version.values())
        for group in self.optimizer.param_groups:
            tensors.update(id(param) for param in group["params"])
        tensors.update(_graph_leaves(pipeline_stage_stashed_graphs(self.stage)))
        return -(-len(tensors) // len(self.versions[0]))

    # --- the delink and checkpoints ----------------------------------------------------------------------------
    def delinked(self, mapping: dict[str, str], start: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """After the delink changed the module (drained first): both sets follow the new layout (`mapping`: {new stage
        name: old stage name}). The installed set is the module's; the other is delinked alike (each new weight a copy
        of the weight its depth ran, started as the module's was: `start(new stage name, copy)`, the plan's
        `DelinkPlan.start_copy`, which zeroes and scales function-preserving growth's residual outputs in place). The
        optimizer to come is made over the module's parameters."""
        installed = self.installed  # after `drain()`, the newest weights (the last update went there)
        other = self.versions[1 - installed]
        self.versions[installed] = dict(self.stage.submod.named_parameters())
        with torch.no_grad():
            copies = {name: start(name, other[source].detach().clone()) for name, source in mapping.items()}
        self.versions[1 - installed] = {
            name: nn.Parameter(copy, requires_grad=other[mapping[name]].requires_grad) for name, copy in copies.items()
        }
        self.optimizer_set = installed
        if self.previous_update:  # each copy received its block's last update (the difference of the two versions)
            self.previous_update = {
                name: start(name, self.previous_update[source].clone()) for name, source in mapping.items()
            }

    def state_dict(self, name_of: Callable[[str], str]) -> dict:
        """What a checkpoint keeps of the schedule beside the module's weights (after `drain()`): the other weight
        version (under `name_of` each stage name) and the batch counters."""
        other = self.versions[self.batches % 2]
        state = {
            "other_version": {name_of(name): param.detach() for name, param in other.items()},
            "batches": self.batches,
            "updated": self.updated,
        }
        if self.delay_correction != "none":
            state["previous_update"] = {name_of(name): update for name, update in self.previous_update.items()}
        return state

    def load_state_dict(self, state: dict, name_of: Callable[[str], str]) -> None:
        """Restore `state_dict` into a schedule whose module already holds the saved (newest) weights and whose
        optimizer is over them."""
        self.batches, self.updated = state["batches"], state["updated"]
        newest = (self.batches - 1) % 2  # where the last update went: the module's parameters
        if self.installed != newest:  # the module's set (and the optimizer's) must be the newest
            self.versions.reverse()
        self.installed = self.optimizer_set = newest
        with torch.no_grad():
            for name, param in self.versions[1 - newest].items():
                param.copy_(state["other_version"][name_of(name)])
        if self.delay_correction != "none":  # a checkpoint saved without it: the correction starts afresh
            saved = state.get("previous_update", {})
            self.previous_update = {
                name: saved[name_of(name)].to(param.device).clone()
                for name, param in self.versions[newest].items()
                if name_of(name) in saved
            }


def _clone(params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    return {
        name: nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad) for name, param in params.items()
    }


def _start(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(ops: list[dist.P2POp]) -> None:
    for work in _start(ops):
        work.wait()


def _graph_leaves(nodes) -> set[int]:
    """ids of the leaf tensors (parameters and received activations) the autograd graphs of `nodes` reach."""
    seen, leaves = set(), set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, nn.Parameter):
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves
