"""A checkpoint folder written cooperatively by the processes that hold the model in pieces (pipeline stages, FSDP2
shards), never the whole state dict in one process's memory.

Every process passes the tensors it holds under the model's global names: whole tensors (a pipeline stage's, replicas
allowed: a shared block on several stages, a stage on several data-parallel pipelines) or FSDP2 DTensors sharded on
their first dimension (`Shard(0)`, possibly over several mesh dimensions, or replicated over some). Sharded on the
first dimension, a process's rows are one contiguous byte range of the tensor in a safetensors file, so:

1. the processes exchange what they hold (names, dtypes, shapes and row ranges: metadata, no weights);
2. the first process plans the files as `write_checkpoint` plans them (the same names in the same order, so the same
   shards and headers), creates each in the temporary folder of `atomic_directory` with its header and its blocks
   allocated, and tells the others where they are;
3. every range is written by one process (the lowest rank holding it), with `writer.write_tensor` straight from the
   tensor's memory (CPU, contiguous, same dtype) or through one 16 MB buffer (a GPU tensor);
4. after all have written (one collective, which also carries a failure anywhere), the first process writes the index,
   config, generation config, code and tokenizer (`save.save_model`'s own), and renames the folder into place.

A MoE model's 3-D experts, which `save_pretrained` writes one tensor per expert (Mixtral's names), are passed by
each process as the whole experts its rows hold (`saved_pieces`). The folder is the one `save_model` writes from the
gathered state dict, tensor for tensor (tested: bit for bit). The
folder must be on a filesystem every process sees (one machine, or a shared filesystem across machines).
"""

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from .dcp_weights import expert_part
from .headers import DTYPE_CODE_OF, parse_size, plan_shards, write_index
from .save import save_model
from .writer import create_file, write_tensor

Rows = tuple[int, int]  # [start, stop) along the first dimension (a 0-d tensor: (0, 1))


def save_model_from_shards(
    model: PreTrainedModel,
    folder: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    max_shard_size: int | str = "5GB",
    **save_kwargs,
) -> Path:
    """Write the checkpoint folder of `model` (its config and class: a skeleton on the meta device is enough) whose
    weights the processes of `group` (default: all) hold in pieces; `tensors` are this process's, under the model's
    names (see the module docstring). Call on every process of `group`; returns the folder, complete, on every
    process. `save_kwargs` go to `save_model` (`tokenizer`, `remote_code`, `config`, `overwrite`, `progress`).

    What no process holds (a missing name or rows) and pieces that disagree (dtype, shape) raise `ValueError` on every
    process before anything is written; a failure while writing, on any process, fails every process, and the
    temporary folder is removed (`atomic_directory`).

    ```python
    >>> with torch.device("meta"):
    ...     skeleton = P2RForCausalLM(config)
    >>> save_model_from_shards(skeleton, "out/real", dict(pipeline.named_parameters()), tokenizer=tokenizer)
    ```
    """
    max_shard_size = parse_size(max_shard_size)
    order, tensors = saved_pieces(model, tensors)
    mine = {name: _local_rows(name, tensor) for name, tensor in tensors.items()}
    held: list = [None] * dist.get_world_size(group)
    described = {name: (str(local.dtype).removeprefix("torch."), shape, rows) for name, (local, shape, rows) in
                 mine.items()}  # fmt: skip
    dist.all_gather_object(held, described, group=group)  # metadata only
    specs, writers = assign_writers(held)  # the same answer (or error) on every process
    rank = dist.get_rank(group)
    assigned = {name for (name, _), writer in writers.items() if writer == rank}
    if rank != 0:
        # The first process's word: the files are there (or it failed); every process's (`_write_pieces` raises if
        # one failed); the first process's again: the folder is in place (or it failed).
        message = _broadcast(None, group)
        if message[0] == "files":
            _write_pieces(Path(message[1]), message[2], mine, assigned, folder, group)
            message = _broadcast(None, group)
        if message[0] == "failed":
            raise (OSError if message[2] else RuntimeError)(message[1])
        return Path(folder)

    stage = ["start"]  # -> "files" once the others have them, -> "written" once every process wrote its rows

    def write_weights(tmp: Path, names: dict[str, torch.Tensor]) -> None:
        shards = plan_shards({name: (DTYPE_CODE_OF[specs[name][0]], specs[name][1]) for name in names}, max_shard_size)
        offsets = {filename: _create_file(tmp / filename, specs, names) for filename, names in shards.files.items()}
        _broadcast(("files", str(tmp), offsets), group)
        stage[0] = "files"
        _write_pieces(tmp, offsets, mine, assigned, folder, group)  # raises on every process if one failed
        stage[0] = "written"
        write_index(tmp, shards)

    names = [name for name in order if name in specs] + sorted(set(specs) - set(order))  # (then any other, sorted)
    skeleton = {name: torch.empty(specs[name][1], dtype=getattr(torch, specs[name][0]), device="meta") for name in
                names}  # fmt: skip
    try:
        save_model(model, folder, state_dict=skeleton, max_shard_size=max_shard_size, write_weights=write_weights,
                   converted=True, **save_kwargs)  # fmt: skip
    except BaseException as error:
        if stage[0] != "files":  # (a failed write of the rows: every process knows and raises already)
            _broadcast(("failed", *_failure_line(error, folder, 0)), group)
        raise
    _broadcast(("done",), group)
    return Path(folder)


def assign_writers(held: list[dict]) -> tuple[dict[str, tuple[str, tuple]], dict[tuple[str, Rows], int]]:
    """From what each process holds (`held[rank]`: {name: (dtype, shape, rows)}): every name's (dtype, shape), and
    {(name, rows): the rank that writes them}. A name some process holds whole is written by the lowest such rank;
    else its distinct row ranges, each by the lowest rank holding it, must tile the first dimension. ValueError
    naming the tensor otherwise."""
    specs: dict[str, tuple[str, tuple]] = {}
    pieces: dict[str, dict[Rows, int]] = {}
    for rank, described in enumerate(held):
        for name, (dtype, shape, rows) in described.items():
            spec = (dtype, tuple(shape))
            if specs.setdefault(name, spec) != spec:
                raise ValueError(f"{name}: processes hold it as {specs[name]} and as {spec} (dtype, shape)")
            pieces.setdefault(name, {}).setdefault(tuple(rows), rank)
    writers: dict[tuple[str, Rows], int] = {}
    for name, ranges in pieces.items():
        length = _rows_of(specs[name][1])
        if (0, length) in ranges:
            writers[name, (0, length)] = ranges[0, length]
            continue
        end = 0
        for start, stop in sorted(rows for rows in ranges if rows[0] < rows[1]):
            if start != end:
                raise ValueError(f"{name}: no process holds rows {end} to {start} of its {length}")
            writers[name, (start, stop)] = ranges[start, stop]
            end = stop
        if end != length:
            raise ValueError(f"{name}: no process holds rows {end} to {length} of its {length}")
    return specs, writers


def _local_rows(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], Rows]:
    """(this process's piece as a plain tensor, the whole tensor's shape, the rows of it the piece holds)."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return tensor.detach(), shape, (0, _rows_of(shape))
    start, stop = 0, _rows_of(shape)
    mesh = tensor.device_mesh
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard(0) or not shape:
            raise ValueError(f"{name}: placed as {placement}; only shards of the first dimension are written")
        # torch.chunk's split, as DTensor's Shard places the rows
        chunk = math.ceil((stop - start) / mesh.size(dim))
        start = min(start + mesh.get_local_rank(dim) * chunk, stop)
        stop = min(start + chunk, stop)
    local = tensor.to_local().detach()
    if shape and local.shape[0] != stop - start:
        raise ValueError(f"{name}: its local piece has {local.shape[0]} rows, its placement gives {stop - start}")
    return local, shape, (start, stop)


def _rows_of(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def saved_pieces(
    model: PreTrainedModel, tensors: Mapping[str, torch.Tensor]
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(the names `save_pretrained` writes for `model`, in its order; this process's `tensors` under those names).

    The identity but for a MoE model, whose 3-D experts `save_pretrained` writes one tensor per expert (Mixtral's
    layout, transformers' `revert_weight_conversion`): a process holding rows [start, stop) of an experts tensor (an
    FSDP2 shard of its first dimension, the expert; or the whole tensor) holds experts start..stop-1 whole, and passes
    each of their projections as a whole tensor, the router under its new name. A DeepSpeed ZeRO-3 model's parameters
    are empty placeholders: their declared shape (`ds_shape`) is the tensor's."""
    state = model.state_dict(keep_vars=True)
    skeleton = {name: torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta") for name, t in
                state.items()}  # fmt: skip
    saved = revert_weight_conversion(model, dict(skeleton))
    if list(saved) == list(skeleton):
        return list(skeleton), dict(tensors)
    pieces = {}
    for name, meta in saved.items():
        part = None if name in tensors else expert_part(name, meta.shape[0] if meta.dim() else 1)
        if part is None:
            if name in tensors:
                pieces[name] = tensors[name]
            continue
        source, index = part
        if source not in tensors:  # (held by another process, e.g. another pipeline stage)
            continue
        if index is None:
            pieces[name] = tensors[source]
            continue
        local, _, (start, stop) = _local_rows(source, tensors[source])
        if start <= index[0] < stop:
            pieces[name] = local[(index[0] - start, *index[1:])].contiguous()
    return list(saved), pieces


def _create_file(path: Path, specs: Mapping, names: list[str]) -> dict[str, int]:
    """Create the safetensors file `path` for `names`: its header (what `write_checkpoint` writes) and its blocks
    allocated; returns {name: offset of its data in the file}."""
    fd, offsets = create_file(path, {name: (getattr(torch, specs[name][0]), tuple(specs[name][1])) for name in names},
                              {"format": "pt"})  # fmt: skip
    os.close(fd)
    return offsets


def _write_pieces(
    folder: Path, offsets: Mapping[str, Mapping[str, int]], mine: Mapping, assigned: set, destination, group
) -> None:
    """Write this process's assigned rows into the files the first process created, then learn whether every process
    did (a collective): if one failed, every process raises, that one its own error, the others an `OSError` (a write
    the system refused: a full disk) or `RuntimeError` saying which process failed and why, in one line."""
    error = None
    try:
        buffer: list = []
        for filename, places in offsets.items():
            names = [name for name in places if name in assigned]
            if not names:
                continue
            fd = os.open(folder / filename, os.O_WRONLY)
            try:
                for name in names:
                    local, shape, (start, _) = mine[name]
                    row_bytes = math.prod(shape[1:]) * local.element_size()
                    try:
                        write_tensor(fd, places[name] + start * row_bytes, local, local.dtype, buffer)
                    except OSError as failure:
                        raise OSError(failure.errno, failure.strerror, str(folder / filename)) from None
            finally:
                os.close(fd)
    except BaseException as failure:  # the others must still meet this process at the collective below
        error = failure
    outcomes: list = [None] * dist.get_world_size(group)
    line = None if error is None else _failure_line(error, destination, dist.get_rank(group))
    dist.all_gather_object(outcomes, line, group=group)
    if error is not None:
        raise error
    failed = [outcome for outcome in outcomes if outcome is not None]
    if failed:
        text, system = failed[0]
        raise (OSError if system else RuntimeError)(text)


def _failure_line(error: BaseException, destination, rank: int) -> tuple[str, bool]:
    """(one line saying that process `rank` failed to write `destination` and why, whether the system refused it)."""
    return f"{destination}: not written, process {rank} failed: {error}", isinstance(error, OSError)


def _broadcast(value, group):
    """`value` of the group's first process, on every process of `group`."""
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


__all__ = ["assign_writers", "save_model_from_shards"]
