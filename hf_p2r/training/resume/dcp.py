"""Sharded resume checkpoints (`checkpoint_format: dcp`): torch.distributed.checkpoint (DCP) under the model's global
names, so that another layout can resume them.

Every process writes its own shards (`dcp.save`: a replicated tensor is written once, a sharded one as its shards),
nothing is gathered to one process. The checkpoint holds

- `model.<name>`: the weights under the names of the whole model's `named_parameters()` (a tied head under the
  embeddings' name), whatever holds them: one process, DDP, FSDP2 shards (DTensors), a pipeline's stages, DeepSpeed
  ZeRO-3's partitions (the fp32 master weights, each whole tensor written by one process:
  `hf_p2r.distributed.deepspeed.zero3_training_state`);
- `optimizer.<name>.<key>`: each parameter's optimizer state under its name (AdamW's `exp_avg`, `exp_avg_sq`, `step`),
  sharded like its parameter. The parameter groups are not saved: they come from the configuration, which a resumed
  run shares (`read_state`), and the learning rate is set before every step;
- a pipeline's 2BW state (`pipedream.py`): `schedule.other_version.<name>` (the older weight version),
  `schedule.previous_update.<name>` (the delay correction's d(t-1), with `pipeline_delay_correction`) and the batch
  counters.

DCP reshards on load: each process asks for its own parameters' pieces, so a checkpoint of 2 data-parallel processes
resumes on 1 (or FSDP2 on one process and back), a pipeline of 2 stages on 3 or with another split. A flush schedule
resumed from a 2BW checkpoint continues from the newest weights (those its module holds, which the optimizer stepped)
and drops the older version and the delay correction's buffers: a flush schedule has one weight version and no
delayed update. A 2BW run resumed from a flush checkpoint starts its schedule as a new 2BW run does: both versions
are the loaded weights, no correction yet. A 2BW run may switch `pipeline_delay_correction` at a resume (the engine
says so in a line): off drops the checkpoint's correction buffers, on starts the correction afresh. RNG states are
not saved: the trainer draws no random numbers after its start (the data order is a function of `seed` and the data
position; the trainer's models keep `attention_dropout` 0, their only random layer).

`check_files` checks the files before anything loads (`hf_p2r.checkpoint.dcp_metadata`): the `.metadata` file, every
shard it names a regular file within the checkpoint's folder (never `..`, an absolute path or a link out of it) as
long as the pieces it holds there, and every tensor tiled exactly by its pieces. `.metadata` is a pickle: it is read by
`compat.dcp_reader`, which lets it name only DCP's metadata records (torch's own reader would run whatever a crafted
file names); the shards' tensors torch reads with `torch.load(weights_only=True)`. Every load plans with
`CoveringLoadPlanner`, which refuses, before reading, a plan that leaves part of a tensor unwritten.

Within `background_writes` (`checkpoint_async`, the save protocol's choice: `resume.checkpoints`), `save`
starts `dcp.async_save` instead: the state is copied to CPU memory (torch's default stager: a copy even of CPU
tensors, so training may change them at once), then a background thread writes it and the future completes.
Its collectives run on a gloo group of their own (`_background_group`): the training's own collectives go on meanwhile
on the default group (gloo on CPU, where two threads' collectives on one group would interleave; NCCL on GPUs, which
`async_save` refuses: it needs a CPU backend).
"""

import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...checkpoint.dcp_metadata import METADATA, CoveringLoadPlanner, read_dcp_metadata
from ...compat import dcp_reader
from ...errors import printable

if TYPE_CHECKING:  # (a pipeline's modules, torch.distributed.pipelining's among them, load where a pipeline runs)
    from ...distributed.pipeline import Pipeline


def is_dcp_checkpoint(path: Path) -> bool:
    return os.path.lexists(Path(path) / METADATA)


def check_files(path: Path) -> None:
    """`InputError` naming the first damaged file of DCP checkpoint `path`, before anything is loaded: an unreadable
    `.metadata`, a shard it names that is missing, outside `path` (`..`, an absolute path, a link out of it) or shorter
    than the pieces it holds there (truncated), a tensor its pieces do not tile exactly
    (`hf_p2r.checkpoint.dcp_metadata.read_dcp_metadata`)."""
    read_dcp_metadata(path)


_BACKGROUND: ContextVar[list[Future] | None] = ContextVar("background_writes", default=None)


@contextmanager
def background_writes() -> Iterator[list[Future]]:
    """Within it, `save` returns once `state` is copied to CPU memory and writes it in a background thread
    (`dcp.async_save`); the futures of the saves it started are in the list it yields (`wait` for each)."""
    futures: list[Future] = []
    token = _BACKGROUND.set(futures)
    try:
        yield futures
    finally:
        _BACKGROUND.reset(token)


def save(folder: Path, state: dict) -> None:
    """Every process writes its part of `state` into `folder` (a collective when a process group is up). A failure is
    raised as it happened (an `OSError` for a full disk...), this process's own if it had one, else the first
    process's: DCP's `CheckpointException` (a `BaseException`) would pass the save protocol's handlers. Within
    `background_writes`, only the copy to CPU memory happens here: `wait` raises the write's failure."""
    futures = _BACKGROUND.get()
    try:
        if futures is None:
            dcp.save(state, checkpoint_id=folder)
        else:
            futures.append(dcp.async_save(state, checkpoint_id=folder, process_group=_background_group()))
    except CheckpointException as error:
        raise _raised(error) from None


def wait(future: Future) -> None:
    """Wait for the asynchronous `save` of `future`; its failure raised as `save` raises one (DCP gives every process
    the same outcome: a shard that failed anywhere fails the save everywhere)."""
    try:
        future.result()
    except CheckpointException as error:
        raise _raised(error) from None


def _raised(error: CheckpointException) -> BaseException:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return _failure(error, rank if rank in error.failures else min(error.failures))


_GROUP: dict = {}  # the default process group -> the gloo group of its background writes


def _background_group() -> dist.ProcessGroup | None:
    """The gloo group over every process that the background writes' collectives use, made once per default group (a
    collective: every process saves at the same step); None without a process group (one process)."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _GROUP.get("world") is not world:
        _GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _GROUP["group"]


def release_background_group() -> None:
    """Destroy the background writes' gloo group now (after the last write completed), not at the interpreter's exit,
    where gloo's threads abort the process ("terminate called without an active exception", SIGABRT: seen once in a
    two-process test under load on torch 2.15). The engines call it when they release what they built."""
    group = _GROUP.pop("group", None)
    _GROUP.clear()
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def load(path: Path, state: dict) -> None:
    """`dcp.load` of `state` (its tensors loaded in place) from `path`; a checkpoint that does not fit `state` (a
    missing name, another shape) is a `ValueError` with the first process's first failure (DCP raises a
    `BaseException` holding every process's traceback), the same on every process. A tensor of `state` the checkpoint's
    pieces do not cover wholly is refused before anything is read (`CoveringLoadPlanner`)."""
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=dcp_reader(path), planner=CoveringLoadPlanner())
    except CheckpointException as error:
        rank = min(error.failures)
        failure = _failure(error, rank)
        text = next((line.strip() for line in str(failure).splitlines() if line.strip()), type(failure).__name__)
        text = printable(text, 400)  # (a key of the checkpoint, quoted: its control characters escaped)
        raise ValueError(f"{text} (process {rank})" if dist.is_initialized() else text) from None


def _failure(error: CheckpointException, rank: int) -> BaseException:
    failure = error.failures[rank]
    return failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)


# --- one process, DDP, FSDP2 (the Accelerate engine) ---------------------------------------------------------------
def model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": weights, "optimizer": per-parameter state} of a model that is one module (plain, DDP, FSDP2), by
    torch's `get_model_state_dict` / `get_optimizer_state_dict` (names without wrappers' prefixes; FSDP2: DTensor
    shards). A tied head is left out (it is the embeddings' weight, saved under their name)."""
    weights = get_model_state_dict(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer)["state"]
    return {"model": _untied(model, weights), "optimizer": optimizer_state}


def load_model_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load DCP checkpoint `path` into `model` and `optimizer` (as `model_state` lays them out), resharded to this
    process's layout."""
    weights = get_model_state_dict(model)
    full = get_optimizer_state_dict(model, optimizer)  # a new optimizer's state is initialised (zeros) to load into
    state = {"model": _untied(model, weights), "optimizer": full["state"]}
    load(path, state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # (the tied head: the same)
    set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": full["param_groups"]})


def _untied(model: nn.Module, weights: dict) -> dict:
    config = getattr(_unwrapped(model), "config", None)
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return weights


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP


def load_zero3_state(path: Path, engine) -> None:
    """Load DCP checkpoint `path` (saved by any layout) into a DeepSpeed ZeRO-3 `engine`: each process loads the whole
    tensors it keeps in `zero3_training_state` (`zero3_owned_names`: about 1/N of the model and its optimizer state),
    then `set_zero3_training_state` hands every process its partitions, one parameter at a time."""
    from ...distributed.deepspeed import set_zero3_training_state, zero3_owned_names, zero3_shapes

    saved = dcp_reader(path).read_metadata().state_dict_metadata
    shapes = zero3_shapes(engine)
    state: dict = {"model": {}, "optimizer": {}}
    for name in zero3_owned_names(engine):
        state["model"][name] = torch.empty(shapes[name])
        prefix = f"optimizer.{name}."
        keys = [key.removeprefix(prefix) for key in saved if key.startswith(prefix) and "." not in key[len(prefix) :]]
        if keys:
            state["optimizer"][name] = {
                key: torch.zeros(()) if key == "step" else torch.empty(shapes[name]) for key in sorted(keys)
            }
    load(path, state)
    set_zero3_training_state(engine, state)


# --- pipelines -------------------------------------------------------------------------------------------------------
def pipeline_state(pipeline: "Pipeline", optimizer: torch.optim.Optimizer) -> dict:
    """What this process saves of a pipelined run (the schedule drained first), under the model's names: its stages'
    weights, their optimizer state, 2BW's older weight version, delay-correction buffers and counters."""
    pipeline.drain()
    params = dict(pipeline.named_parameters())
    names = {id(param): name for name, param in params.items()}
    state = {
        "model": {name: param.detach() for name, param in params.items()},
        "optimizer": {names[id(param)]: dict(values) for param, values in optimizer.state.items()},
    }
    schedule = pipeline.schedule.state_dict(pipeline.name_of)
    if schedule:  # 2BW
        state["schedule"] = {
            "other_version": schedule["other_version"],
            "counters": torch.tensor([schedule["batches"], schedule["updated"]]),
        }
        if "previous_update" in schedule:
            state["schedule"]["previous_update"] = schedule["previous_update"]
    return state


def load_pipeline_state(path: Path, pipeline: "Pipeline", optimizer: torch.optim.Optimizer) -> None:
    """Load DCP checkpoint `path` into this process's stages and `optimizer` (over `pipeline.parameters()`), in place,
    whatever split, number of stages or schedule saved it (see the module docstring for 2BW <-> a flush schedule)."""
    init_optimizer_state(optimizer)
    saved = dcp_reader(path).read_metadata().state_dict_metadata
    state = pipeline_state(pipeline, optimizer)  # this process's tensors themselves: DCP loads into them
    schedule = state.pop("schedule", None)  # 2BW's, when this run's schedule is 2BW
    if schedule is not None and "schedule.counters" in saved:  # 2BW -> 2BW, read into new tensors (then placed by
        # the schedule's own `load_state_dict`: the live other version may be the module's set before it swaps them)
        schedule["other_version"] = {name: torch.empty_like(t) for name, t in schedule["other_version"].items()}
        schedule["previous_update"] = {
            name: torch.zeros_like(param)
            for name, param in pipeline.named_parameters()
            if f"schedule.previous_update.{name}" in saved and pipeline.delay_correction != "none"
        }
        state["schedule"] = schedule
    load(path, state)
    if schedule is None:  # a flush schedule: the module's weights are the newest, nothing else to restore
        return
    if "schedule" not in state:  # a flush schedule's checkpoint: 2BW starts as a new run does, both versions the
        schedule = pipeline.schedule  # loaded weights (the module's: `installed`), no delay correction yet
        with torch.no_grad():
            for name, param in schedule.versions[1 - schedule.installed].items():
                param.copy_(schedule.versions[schedule.installed][name])
        return
    batches, updated = (int(value) for value in state["schedule"]["counters"])
    loaded = {"batches": batches, "updated": updated, **state["schedule"]}
    pipeline.schedule.load_state_dict(loaded, pipeline.name_of)


def saved_schedule(path: Path) -> set[str]:
    """What 2BW state DCP checkpoint `path` holds: "other_version" (a 2BW checkpoint), "previous_update" (its delay
    correction's buffers)."""
    keys = dcp_reader(path).read_metadata().state_dict_metadata
    return {
        part for part in ("other_version", "previous_update") if any(k.startswith(f"schedule.{part}.") for k in keys)
    }


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of `optimizer` its state (zeros) if it has none yet, so a checkpoint can load into it: one
    step at learning rate 0 on zero gradients (what torch's `get_optimizer_state_dict` does), the gradients and rates
    restored after."""
    if optimizer.state:
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    grads = [param.grad for param in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not torch.is_tensor(group["lr"]) else torch.zeros_like(group["lr"])
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
