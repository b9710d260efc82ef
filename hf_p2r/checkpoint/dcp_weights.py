"""A DCP training checkpoint's weights (`checkpoint_format: dcp`) written as safetensors, one tensor at a time.

A DCP checkpoint holds the model's weights as `model.<name>` under the whole model's parameter names, in pieces
that the processes of the run wrote (`hf_p2r.training.resume.dcp`). `write_dcp_weights` is the `write_weights` of
`save_model`: it plans the shards as `write_checkpoint` does (same files, same headers, same bytes), then fills them
tensor by tensor, each one read whole from its pieces by DCP's own reader (`dcp.load` of that one tensor, without a
process group) and written, before the next is read. Memory: a few copies of the largest tensor (DCP unpickles a
piece into a tensor of its own, then copies it into the one asked for), never the state dict: measured, about 6 times
the largest tensor whatever the model's size (tests/checkpoint/test_dcp_weights.py: 16 MB for a 102 MB model).

A mixture-of-experts model's 3-D experts (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`, as the
model holds and DCP saves them) are written under the names `save_pretrained` writes (one tensor per expert and
projection, `block_sparse_moe.experts.<e>.w1/w2/w3.weight`, as `source.split_experts` reads them): a layer's 3-D
tensor is read once and its experts written from it.

```python
>>> save_model(skeleton, "out", write_weights=lambda folder, tensors: write_dcp_weights("checkpoint-200", folder,
...     tensors))
```
"""

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from tqdm.auto import tqdm

from ..compat import dcp_reader
from ..errors import InputError, printable
from .dcp_metadata import METADATA, CoveringLoadPlanner, read_dcp_metadata
from .headers import DTYPE_CODE_OF, NAME_LIMIT, parse_size, plan_shards, write_index
from .writer import create_file, write_tensor

MODEL = "model."  # the prefix of the weights' entries (`hf_p2r.training.resume.dcp`)
# A sparse layer's tensors as `save_pretrained` writes them, and as the model (and DCP) holds them.
_EXPERT = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+\.)block_sparse_moe\.(?:experts\.(?P<e>\d+)\.(?P<w>w[123])|gate)\."
)


def dcp_weights(checkpoint: str | os.PathLike) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of the model weights in DCP checkpoint folder `checkpoint` (its `model.<name>` entries),
    read from its `.metadata`, checked by `read_dcp_metadata` (every file it names within the folder, every tensor
    tiled by its pieces). `InputError` naming the folder if it is not a DCP checkpoint or holds no weights, or naming
    the file and the problem (refused before any piece is read)."""
    checkpoint = Path(checkpoint)
    if not os.path.lexists(checkpoint / METADATA):
        raise InputError(f"{checkpoint}: not a DCP checkpoint (no {METADATA}; written with checkpoint_format: dcp)")
    metadata = read_dcp_metadata(checkpoint)
    weights = {
        key.removeprefix(MODEL): (entry.properties.dtype, tuple(entry.size))
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL)
    }
    if not weights:
        raise InputError(f"{checkpoint}: holds no model weights (no '{MODEL}*' tensors in {METADATA})")
    return weights


def read_dcp_tensor(checkpoint: str | os.PathLike, name: str, dtype: torch.dtype, shape: tuple[int, ...]):
    """The whole tensor `name` (a `dcp_weights` name) of DCP checkpoint `checkpoint`, gathered from its pieces by
    `dcp.load` in this process alone (no process group). A piece that does not load (a damaged shard), or a tensor its
    pieces do not cover wholly (`CoveringLoadPlanner`: refused before it is read into), is `InputError` with DCP's first
    line."""
    tensor = torch.empty(shape, dtype=dtype)  # (written whole, or refused: the planner checks the plan tiles it)
    try:
        with warnings.catch_warnings():  # (torch says it loads in one process even when told so)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                {MODEL + name: tensor},
                storage_reader=dcp_reader(checkpoint),
                planner=CoveringLoadPlanner(),
                no_dist=True,
            )
    except CheckpointException as error:  # a BaseException holding each process's failure
        failure = next(iter(error.failures.values()))
        failure = failure[0] if isinstance(failure, tuple) else failure
        line = next((text.strip() for text in str(failure).splitlines() if text.strip()), type(failure).__name__)
        raise InputError(f"{checkpoint}: {MODEL}{name} does not load ({line})") from None
    return tensor


def write_dcp_weights(
    checkpoint: str | os.PathLike,
    folder: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> list[Path]:
    """Write the weights named by `tensors` (the names `save_model` writes, in order; meta tensors: only their shapes
    count) into `folder` as `write_checkpoint` writes them, reading each from DCP checkpoint `checkpoint`, in the dtype
    it is stored in there; returns the files written. A name the checkpoint lacks, or holds with another shape, is
    `InputError` before any file is written."""
    checkpoint = Path(checkpoint)
    stored = dcp_weights(checkpoint)
    sources = {name: _source(checkpoint, name, tuple(tensor.shape), stored) for name, tensor in tensors.items()}
    specs = {name: (stored[source][0], tuple(tensors[name].shape)) for name, (source, _) in sources.items()}
    shards = plan_shards(
        {name: (DTYPE_CODE_OF[str(dtype).removeprefix("torch.")], shape) for name, (dtype, shape) in specs.items()},
        parse_size(max_shard_size),
    )
    total = sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs.values())
    written, held, buffer = [], (None, None), []  # held: the last tensor read (a layer's 3-D experts serve E names)
    with tqdm(total=total, unit="B", unit_scale=True, disable=None if progress else True) as bar:
        for filename, names in shards.files.items():
            path = folder / filename
            fd, offsets = create_file(path, {name: specs[name] for name in names}, {"format": "pt"})
            try:
                for name in names:
                    source, index = sources[name]
                    if held[0] != source:
                        held = (None, None)  # the previous one freed before the next is read
                        held = (source, read_dcp_tensor(checkpoint, source, *stored[source]))
                    part = held[1][index] if index is not None else held[1]
                    try:
                        write_tensor(fd, offsets[name], part, specs[name][0], buffer)
                    except OSError as error:
                        raise OSError(error.errno, error.strerror, str(path)) from None
                    bar.update(part.numel() * part.element_size())
                    del part  # (a view keeps its tensor alive)
            finally:
                os.close(fd)
            written.append(path)
    return written + write_index(folder, shards)


def expert_part(name: str, rows: int) -> tuple[str, tuple | None] | None:
    """Where a weight of Mixtral's layout (the names `save_pretrained` writes for a P2R MoE model) lies in the model's
    own state dict: (the model's name, the index of the part: (expert,) of `down_proj`, (expert, rows) of
    `gate_up_proj`, whose first `rows` rows are w1 and next w3; None for the whole, the router), or None for a name
    of neither (`rows`: the weight's first dimension)."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    if match["e"] is None:
        return f"{match['layer']}mlp.gate.weight", None
    if match["w"] == "w2":
        return f"{match['layer']}mlp.experts.down_proj", (int(match["e"]),)
    part = slice(0, rows) if match["w"] == "w1" else slice(rows, 2 * rows)
    return f"{match['layer']}mlp.experts.gate_up_proj", (int(match["e"]), part)


def _source(checkpoint: Path, name: str, shape: tuple[int, ...], stored: dict) -> tuple[str, tuple | None]:
    """(the stored tensor `name` is written from, the index of its part in it or None for all of it)."""
    source, index = name, None
    if name not in stored and (part := expert_part(name, shape[0])):  # one expert's projection, or the router
        source, index = part
    if source not in stored:
        raise InputError(
            f"{checkpoint}: holds no {MODEL}{printable(source, NAME_LIMIT)}, a weight of the model it was saved from"
        )
    found = stored[source][1]
    got = found if index is None else tuple(torch.empty(found, device="meta")[index].shape)
    if got != shape:
        raise InputError(
            f"{checkpoint}: {MODEL}{printable(source, NAME_LIMIT)} has shape {list(found)}, but the model its "
            f"trainer_state.json describes has {list(shape)}"
            + (f" for {printable(name, NAME_LIMIT)}" if source != name else "")
        )
    return source, index
