"""Checkpoints and model saves, all written atomically (a temporary folder beside the target, renamed at the end).

A checkpoint is `output_dir/checkpoints/checkpoint-{step}/`: Accelerate's `save_state` (model, optimizer, RNG
states, gradient scaler) plus `trainer_state.json` (stage, step, blocks, data position, the run's configuration). The
model stored there has the blocks it had at that step, so resuming after a delink builds a model with that many blocks
before `load_state`. Those resume checkpoints are Accelerate's format and written by Accelerate (`save_state`, which
handles every engine's sharded states); hf-p2r only makes them atomic. With `checkpoint_format: dcp` the engines write
torch.distributed.checkpoint shards instead (`resume.dcp`: every process its own, under the model's names),
through the same atomic protocol, and another layout resumes them.

The models a run publishes (`pseudo/`, `real/`) are written by `save_model`, through `hf_p2r.checkpoint.save_model`,
the same writer as the converter and the exporter.

Reading one back is checked before anything loads it (`read_state`): `trainer_state.json` field by field, every
safetensors header against its file's size, every torch file for a whole zip and a `weights_only` pickle. A damaged
checkpoint is one `InputError` naming its file, before the run changes anything.
"""

import dataclasses
import errno
import json
import math
import os
import re
import resource
import shutil
import stat
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from pickle import UnpicklingError

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from accelerate.utils import load as torch_load
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedTokenizerBase

from ...checkpoint import atomic_directory
from ...checkpoint import save_model as write_model_folder
from ...checkpoint.dcp_metadata import METADATA as DCP_METADATA
from ...checkpoint.dcp_metadata import read_dcp_metadata
from ...checkpoint.headers import read_header
from ...checkpoint.io import check_only_files_within
from ...compat import prepared_models
from ...config import TrainConfig
from ...config.resume import CHECKPOINTS, STATE_FILE, different_run
from ...errors import InputError, printable, read_json
from ...models.p2r import P2RForCausalLM
from .dcp import background_writes, is_dcp_checkpoint
from .dcp import check_files as check_dcp_files
from .dcp import wait as wait_for_write


@dataclass
class TrainState:
    """Where the run is; everything else (the learning rate, the data order) is a function of these and the config."""

    step: int = 0  # optimizer steps done
    num_blocks: int = 1  # blocks of the model now
    blocks_consumed: int = 0  # data position: training blocks used so far, over all processes
    stream_states: list = dataclasses.field(default_factory=list)  # a streaming source's: each process's, by index
    train_time_s: float = 0.0  # wall time spent in training steps (no evaluation, no saving)
    log_loss_sum: float = 0.0  # training loss summed over the steps since the last metrics record
    log_steps: int = 0
    metrics_records: int = 0  # records in metrics.jsonl (a resumed run drops those written after the checkpoint)
    # The depth the model runs now (a shallow pseudo stage's d < L; 0: L, in checkpoints written before depth growth),
    # and the training tokens and model FLOPs so far (`metrics.training_flops_per_token`; counted from 0 when resuming
    # a checkpoint written before they were).
    num_hidden_layers: int = 0
    tokens: int = 0
    flops: float = 0.0

    def stage(self, depth: int) -> str:
        """ "pseudo" while the model has fewer blocks or fewer layers than the real model's `depth` layers, then
        "real"."""
        return "pseudo" if self.num_blocks < depth or (self.num_hidden_layers or depth) < depth else "real"


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"checkpoint-{step}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temporary folders of interrupted saves are ignored, and so
    is a link: a run prunes only folders it wrote, never through a link to another run's)."""
    folder = Path(output_dir) / CHECKPOINTS
    found = [
        p
        for p in folder.glob("checkpoint-*")
        if not p.is_symlink() and (p / STATE_FILE).is_file() and _step_of(p) is not None
    ]
    return sorted(found, key=_step_of)


def _step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else None


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    state: TrainState,
    config: TrainConfig,
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write `checkpoint-{step}` atomically and keep the newest `save_total_limit`; call on every process.

    The main process makes the temporary folder and tells the others its name; every process writes its part there
    with `write(folder)` (default: `accelerator.save_state`: model, optimizer, scheduler, RNG states; the pipelined
    trainer writes its stages), and the folder is renamed into place once every process has finished writing. If any
    process fails to write (a full disk), every process raises `OSError` naming the cause and the place, the temporary
    folder is removed and the checkpoints already there are kept (older ones are pruned only after the new one is in
    place). Call it only with finite weights and optimizer state (`all_finite`): what it keeps is what resumes.

    With `checkpoint_async` (DCP's `save` within `resume.dcp.background_writes`) it returns once the state is
    copied to CPU memory: the shards are written in the background, and the main process renames the folder into
    place (then prunes) when its write completes, which DCP completes after every process's. A failed write removes
    the temporary folder; `finish_checkpoint` (the next save, a delink, the end of the run, a signal) raises it as
    above. Until the rename the checkpoint is only its temporary folder, which `list_checkpoints` ignores.
    """
    global _pending
    finish_checkpoint(accelerator)  # the previous save, if it still writes in the background
    write = write or accelerator.save_state
    destination = checkpoint_path(output_dir, state.step)
    payload = {
        "stage": state.stage(config.model.num_hidden_layers),
        "state": dataclasses.asdict(state),
        "config": config.to_dict(),
    }

    def write_main(folder: Path) -> None:
        write(folder)
        (folder / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")

    main = accelerator.is_main_process
    saving = config.checkpointing
    limit = saving.save_total_limit if main else None  # (the main process prunes)
    with ExitStack() as rename, background_writes() if saving.checkpoint_async else nullcontext([]) as futures:
        if main:
            tmp = rename.enter_context(atomic_directory(destination, overwrite=True))  # renamed as the stack closes
            broadcast_object_list([str(tmp)])
        else:
            [tmp] = broadcast_object_list([None])
        try:
            _write_on_every_process(accelerator, write_main if main else write, Path(tmp), destination)
        except BaseException:
            wait_for_futures(futures)  # a write begun in the background ends before its folder is removed
            raise
        if futures:  # the shards are still being written: the rename and the pruning when they are
            [future] = futures
            _pending = _BackgroundSave(future, Path(tmp), destination, rename.pop_all(), Path(output_dir), limit)
            future.add_done_callback(_pending.complete)
            return destination
    _prune(output_dir, limit)
    accelerator.wait_for_everyone()
    return destination


def _prune(output_dir: str | Path, limit: int | None) -> None:
    """Keep the newest `limit` complete checkpoints (None: all); called after a new one is in place."""
    if limit is not None:
        for old in list_checkpoints(output_dir)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)


@dataclass
class _BackgroundSave:
    """A checkpoint whose shards a background thread writes (`checkpoint_async`): `complete` runs when the write ends
    (in that thread): on the main process, which holds the entered `atomic_directory` in `rename`, the folder is
    renamed into place and older checkpoints pruned, or, when the write failed, removed."""

    future: Future
    folder: Path  # the temporary folder
    destination: Path
    rename: ExitStack  # the main process's atomic_directory (empty elsewhere)
    output_dir: Path
    limit: int | None  # save_total_limit on the main process (None elsewhere, or keep all)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None  # what the rename or the pruning raised

    def complete(self, future: Future) -> None:
        try:
            failure = future.exception()
            if failure is None:
                self.rename.close()
                _prune(self.output_dir, self.limit)
            else:
                self.rename.__exit__(type(failure), failure, failure.__traceback__)
        except BaseException as caught:  # noqa: BLE001 - raised by `wait`, on the main thread
            self.error = caught
        finally:
            self.done.set()

    def wait(self, folder: Path) -> None:
        """The write's outcome, as the save protocol's `write` gives it: its failure raised (`dcp.wait`)."""
        self.done.wait()
        wait_for_write(self.future)
        if self.error is not None:
            raise self.error


_pending: _BackgroundSave | None = None  # this process's checkpoint still written in the background


def finish_checkpoint(accelerator: Accelerator) -> None:
    """Wait for this process's checkpoint still written in the background (`checkpoint_async`), if any, and raise its
    failure as `save_checkpoint` raises one (one collective: call on every process, at the same step)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        _write_on_every_process(accelerator, pending.wait, pending.folder, pending.destination)


def checkpoint_writing() -> bool:
    """Whether this process's last checkpoint is still being written in the background (`checkpoint_async`)."""
    return _pending is not None and not _pending.done.is_set()


def abandon_checkpoint() -> None:
    """On the way out of a run that failed: wait for this process's background write (if any) to end, renamed into
    place or removed, before the process group goes; no collective, and its failure (told in one line on stderr) does
    not replace the error that stops the run."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        try:
            pending.wait(pending.folder)
        except BaseException as error:  # noqa: BLE001 - the run's own error follows
            print(f"{pending.destination.name} not saved ({_first_line(error)})", file=sys.stderr)


def _write_on_every_process(accelerator: Accelerator, write, folder: Path, destination: Path) -> None:
    """`write(folder)` on this process, then one collective: if it failed on any process, every process raises (none
    is left waiting for the others): `OSError` with one line for a write the system refused, else the error itself
    where it happened and a `RuntimeError` naming that process elsewhere."""
    error, refused = None, None
    try:
        write(folder)
    except Exception as caught:  # noqa: BLE001 - told to the other processes first, then raised
        error, refused = caught, _write_failure(caught, folder, destination)
    line = refused or (
        error and f"{destination.name} not saved: process {accelerator.process_index} failed ({error!r})"
    )
    failures = [(text, system) for text, system in gather_object([(line, refused is not None)]) if text]
    if error is not None:
        raise (OSError(refused) if refused else error) from None
    if failures:
        text, system = failures[0]
        raise (OSError if system else RuntimeError)(text)


def _write_failure(error: Exception, folder: Path, destination: Path) -> str | None:
    """One line for a write the system refused (a full disk, the file-size limit, an I/O error), None for others.

    torch.save, given a path, reports a short write as "unexpected pos N vs M" without its cause: a full file system
    or a file at the process's file-size limit is then recognised from the folder (statvfs, RLIMIT_FSIZE)."""
    code = error.errno if isinstance(error, OSError) else None
    if code is None and (found := re.search(r"os error (\d+)", str(error))):  # safetensors' writer
        code = int(found.group(1))
    written = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
    short_write = isinstance(error, RuntimeError) and re.search(r"unexpected pos|PytorchStreamWriter", str(error))
    if code is None and short_write:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and any(p.stat().st_size >= limit for p in written):
            code = errno.EFBIG
        elif _free_bytes(destination.parent) < _FULL:
            code = errno.ENOSPC
    if code is None and not short_write:
        return None
    reason = f"{os.strerror(code).lower()} ({errno.errorcode.get(code, code)})" if code else "a short write"
    name = Path(error.filename).name if isinstance(error, OSError) and error.filename else None
    name = name or (written[-1].name if written else None)
    advice = {
        errno.ENOSPC: "free some space (or lower save_total_limit)",
        errno.EDQUOT: "free some space (or lower save_total_limit)",
        errno.EFBIG: "raise the file-size limit (ulimit -f)",
    }.get(code, "check the file system")
    free = _free_bytes(destination.parent) >> 20
    return (
        f"{destination.name} not saved: {reason} writing {name + ' ' if name else ''}into {destination.parent} "
        f"({free} MiB free there); its temporary folder is removed and the checkpoints already there are kept: "
        f"{advice}, then resume with --resume_from_checkpoint latest"
    )


_FULL = 1 << 20  # a file system with less free space than this after a short write is full


def _free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)  # the file system of `folder`: the checkpoints' folder (the temporary one may be gone)
    return stats.f_bavail * stats.f_frsize


def all_finite(accelerator: Accelerator, *objects) -> bool:
    """Whether every floating-point tensor in `objects` (tensors, or dicts / lists / tuples / iterators of them:
    parameters, an optimizer's `state`, a state dict) is finite on every process: one pass over them (each one's
    smallest and largest value, which are NaN or infinite when any is; of a DTensor its local shard), one collective,
    the same answer everywhere."""
    extremes: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in _tensors(objects):
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if tensor.is_floating_point() and tensor.numel():
            tensor = tensor.detach() if tensor.dtype.itemsize > 1 else tensor.detach().float()  # float8: no aminmax
            extremes.setdefault(tensor.device, []).extend(value.float() for value in torch.aminmax(tensor))
    flags = [torch.isfinite(torch.stack(values)).all().to(accelerator.device) for values in extremes.values()]
    bad = torch.tensor(0.0 if all(flag.item() for flag in flags) else 1.0, device=accelerator.device)
    return accelerator.reduce(bad, reduction="sum").item() == 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple | Iterator):  # an Iterator: `model.parameters()`
        for value in obj:
            yield from _tensors(value)


def resolve_checkpoint(output_dir: str | Path, name: str) -> Path:
    """`name` is a checkpoint folder or "latest" (the newest complete one in `output_dir`)."""
    if name == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint in {Path(output_dir) / CHECKPOINTS}")
        return found[-1]
    path = Path(name)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} is not a checkpoint (no {STATE_FILE})")
    return path


def read_state(path: Path, config: TrainConfig) -> TrainState:
    """The state saved in checkpoint `path`, after checking that its files are its own and whole
    (`check_checkpoint_files`), that it belongs to a run like `config` (the model, the data, the optimizer: an
    optimizer's state does not load into another's), and that `config`'s schedule has steps left from it. Every problem
    is one `InputError` naming the file or field, before anything is loaded or changed."""
    check_checkpoint_files(path)
    state, stage, saved = read_trainer_state(path / STATE_FILE)
    if problem := different_run(path, saved, config.to_dict()):  # the fields its weights and groups depend on
        raise InputError(problem)
    depth, args = config.model.num_hidden_layers, config.stages
    if stage not in (None, state.stage(depth)):
        raise InputError(
            f'{path / STATE_FILE}: stage "{stage}" does not match num_blocks {state.num_blocks} of {depth} layers'
        )
    if state.step > args.total_steps:
        raise InputError(
            f"resume_from_checkpoint: {path} is at step {state.step}, past the end of this schedule (pseudo_steps "
            f"{args.pseudo_steps} + real_steps {args.real_steps} = {args.total_steps} steps): raise real_steps to at "
            f"least {state.step - args.pseudo_steps}, or resume from an earlier checkpoint"
        )
    possible = {config.initial_blocks(), *(blocks for _, blocks in config.delink_schedule())}
    if state.num_blocks not in possible or state.num_blocks > config.blocks_at(state.step):
        raise InputError(
            f"resume_from_checkpoint: {path} holds a model with {state.num_blocks} blocks at step {state.step}, but "
            f"this configuration has {config.blocks_at(state.step)} blocks then, {sorted(possible)} in all "
            "(num_unique_layers, pseudo_steps, partial_delink_steps, partial_delink_blocks)"
        )
    stages = [(config.initial_depth(), config.initial_blocks()), *((d, k) for _, d, k in config.stage_schedule())]
    now = config.stage_at(state.step)
    saved_depth = state.num_hidden_layers or depth
    if (saved_depth, state.num_blocks) not in stages[: stages.index(now) + 1]:
        raise InputError(
            f"resume_from_checkpoint: {path} holds a model of {saved_depth} layers and {state.num_blocks} "
            f"blocks at step {state.step}, but this configuration has {now[0]} layers and {now[1]} blocks then "
            "(pseudo_num_hidden_layers, partial_delink_depths, pseudo_steps, partial_delink_steps)"
        )
    return state


def read_trainer_state(path: str | Path) -> tuple[TrainState, str | None, dict]:
    """(state, stage, the run's configuration) of a `trainer_state.json`, each field checked: a missing, extra or
    mistyped one, or a damaged file, is one `InputError` naming the file and the field. ("stage" is for readers, and
    derived from `num_blocks`: None when absent.)"""
    payload = read_json(path)
    _check_keys(path, "", payload, {"state", "config"}, optional={"stage"})
    stage, fields, saved = payload.get("stage"), payload["state"], payload["config"]
    if stage not in (None, "pseudo", "real"):
        raise InputError(f'{path}: "stage" is {_short(stage)}, expected "pseudo" or "real"')
    if not isinstance(saved, dict):
        raise InputError(f'{path}: "config" is {_short(saved)}, expected a JSON object')
    if not isinstance(fields, dict):
        raise InputError(f'{path}: "state" is {_short(fields)}, expected a JSON object')
    names = {field.name for field in dataclasses.fields(TrainState)}
    # stream_states: a map-style run's has none; the depth and the counts: checkpoints written before them have none
    optional = {"stream_states": [], "num_hidden_layers": 0, "tokens": 0, "flops": 0.0}
    _check_keys(path, "state.", fields, names - optional.keys(), optional=optional.keys())
    values = {}
    for field in dataclasses.fields(TrainState):
        value, least = fields.get(field.name, optional.get(field.name)), 1 if field.name == "num_blocks" else 0
        if field.name == "stream_states" and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise InputError(f'{path}: "state.stream_states" is {_short(value)}, expected a list of JSON objects')
        if field.type is int and not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise InputError(f'{path}: "state.{field.name}" is {_short(value)}, expected an integer >= {least}')
        if field.type is float:
            signed = field.name == "log_loss_sum"  # a sum of losses (MoE adds its load-balancing loss)
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (signed or value >= 0)):
                expected = "a finite number" + ("" if signed else " >= 0")
                raise InputError(f'{path}: "state.{field.name}" is {_short(value)}, expected {expected}')
            value = float(value)
        values[field.name] = value
    state = TrainState(**values)
    return state, stage, saved


def _check_keys(path, prefix: str, found: dict, expected: set[str], optional: set[str] = frozenset()) -> None:
    if missing := sorted(expected - found.keys()):
        raise InputError(f"{path}: {', '.join(json.dumps(prefix + k) for k in missing)} missing")
    if extra := sorted(found.keys() - expected - optional):
        raise InputError(f"{path}: unexpected {', '.join(json.dumps(prefix + k) for k in extra)}")


def _short(value) -> str:
    """A JSON value as a message shows it: a scalar as written (cut at 40 characters), a container by its kind."""
    if isinstance(value, dict | list):
        return "a JSON object" if isinstance(value, dict) else "a JSON array"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_checkpoint_files(path: Path) -> None:
    """Check every file of checkpoint folder `path` that a resume loads, without loading it: safetensors headers
    against their file's size (truncation), torch files (`optimizer.bin`, `random_states_*.pkl`, a pipeline's
    `stage-*.pt`) for a complete zip whose pickle holds only tensors and plain containers (`weights_only`,
    memory-mapped: no tensor is read); a DCP checkpoint's `.metadata` and shards (`resume.dcp.check_files`),
    and so the DCP folders an engine's state is saved in (Accelerate's FSDP state: their pickled values too, which
    Accelerate loads with `weights_only=False`, must load with `weights_only=True`). Before any of them: every entry
    of the folder is a regular file within it (`check_only_files_within`: no link out of it, to another checkpoint or
    elsewhere). The first damaged file is an `InputError` naming it."""
    check_only_files_within(path)
    if is_dcp_checkpoint(path):
        check_dcp_files(path)
    for metadata in sorted(path.rglob(DCP_METADATA)):
        if metadata.parent != path:
            read_dcp_metadata(metadata.parent, bytes_entries=True)
    for file in sorted(path.iterdir()):
        if file.suffix not in (".safetensors", ".bin", ".pt", ".pkl"):
            continue  # trainer_state.json (read_trainer_state), engines' folders (FSDP's, DeepSpeed's)
        mode = file.stat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise InputError(f"{file}: not a regular file")
        if file.suffix == ".safetensors":
            try:
                read_header(file)
            except ValueError as error:
                raise InputError(str(error)) from None
        elif not zipfile.is_zipfile(file):
            raise InputError(f"{file}: not a torch.save file (truncated or damaged: its zip directory is missing)")
        else:
            try:
                loaded = torch_load(file, map_location="cpu", mmap=True)
            except UnpicklingError:
                raise InputError(
                    f"{file}: holds objects other than tensors and plain containers (refused: checkpoints load with "
                    "weights_only=True)"
                ) from None
            except Exception as error:  # noqa: BLE001 - torch's reader raises RuntimeError, EOFError, ValueError...
                raise InputError(f"{file}: damaged ({_first_line(error)})") from None
            if file.name.startswith("optimizer") and not (
                isinstance(loaded, dict) and {"state", "param_groups"} <= loaded.keys()
            ):
                raise InputError(f"{file}: not an optimizer state (no 'state' and 'param_groups')")


@contextmanager
def loading_checkpoint(accelerator: Accelerator, path: Path) -> Iterator[None]:
    """Around every process's load of checkpoint `path` (whose files `read_state` checked): what still fails there (a
    state that does not fit this run's model or optimizer) is one `InputError` naming the checkpoint, raised on every
    process (one collective after the load: a process whose part loaded does not go on alone)."""
    error, problem = None, None
    try:
        yield
    except Exception as caught:  # noqa: BLE001 - told to the other processes first, then raised
        problem = f"resume_from_checkpoint: {path} does not fit this run ({printable(_first_line(caught), 400)})"
        error = caught
    failures = [(index, text) for index, text in gather_object([(accelerator.process_index, problem)]) if text]
    if isinstance(error, RuntimeError | ValueError | KeyError | TypeError | IndexError | EOFError | UnpicklingError):
        raise InputError(problem) from None
    if error is not None:
        raise error  # not the checkpoint's content (an I/O error...): as it came
    if failures:
        index, text = failures[0]
        raise InputError(f"{text} (process {index})")


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def save_model(
    accelerator: Accelerator,
    model: P2RForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    remote_code: bool,
) -> None:
    """Save the unwrapped `model` and its tokenizer into `directory` (replaced atomically) as a checkpoint that
    `from_pretrained` loads (`write_model`); with `remote_code`, with the model's code. Call on every process: the full
    state dict is gathered by `accelerator.get_state_dict` on all of them (a collective when the model is sharded:
    FSDP2, ZeRO-3), then the main process writes it."""
    state_dict = accelerator.get_state_dict(_prepared(accelerator, model))
    write_model(accelerator, model, tokenizer, directory, remote_code, state_dict)


def write_model(
    accelerator: Accelerator,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    remote_code: bool,
    state_dict: dict[str, torch.Tensor] | None,
) -> None:
    """The main process writes `state_dict` (the whole model's weights, needed there only) as `model`'s checkpoint
    into `directory` through `hf_p2r.checkpoint.save_model` (`model` may be a skeleton on the meta device); every
    process waits for it. Call on every process."""
    if accelerator.is_main_process:
        write_model_folder(
            model,
            directory,
            state_dict=state_dict,
            remote_code=remote_code,
            tokenizer=tokenizer,
            overwrite=True,
            progress=False,
        )
    accelerator.wait_for_everyone()


def _prepared(accelerator: Accelerator, model: nn.Module) -> nn.Module:
    """What `accelerator.prepare` returned for the unwrapped `model` (a DeepSpeed engine, DDP...), which
    `get_state_dict` needs under ZeRO-3; the model itself when it was prepared in place (one device, FSDP2)."""
    for prepared in prepared_models(accelerator):
        if prepared is model or accelerator.unwrap_model(prepared) is model:
            return prepared
    return model


def discard_after(output_dir: str | Path, step: int) -> None:
    """Remove checkpoints newer than `step`: resuming from `step` abandons what the run wrote after it."""
    for path in list_checkpoints(output_dir):
        if _step_of(path) > step:
            shutil.rmtree(path)
