"""Safetensors headers in plain Python: read and check a checkpoint's headers, plan its shards, and build a header
byte for byte as safetensors builds it.

No torch here: the converter plans and writes a checkpoint from headers alone (see `ranges.py`), and `hf-p2r`
answers at once. A safetensors file is an 8-byte little-endian header length, a JSON header (`__metadata__`, then each
tensor's dtype, shape and `data_offsets` into the data that follows), padded with spaces to a multiple of 8 bytes, and
the tensors' bytes, back to back, in the header's order.
"""

import dataclasses
import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory

from ..compat import parse_size_to_int
from ..errors import InputError, parse_json, printable, read_json
from .io import file_within, why_skipped

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = "model{suffix}.safetensors"
# safetensors' dtype codes, ordered as safetensors orders them (its `Dtype` enum): a file lists its tensors by
# descending dtype, then by name.
DTYPE_CODES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
# Bytes per element, and the torch name of each code (what `TensorSpec` and `torch_dtype` names use).
_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_BYTES.update(dict.fromkeys(("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "BOOL"), 1))
DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}  # fmt: skip
DTYPE_CODE_OF = {name: code for code, name in DTYPE_NAMES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0")
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers
NAME_LIMIT = 200  # characters of a tensor name a message quotes (a crafted header's names may be megabytes long)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: `file`, from byte `offset` (from the start of the file), `nbytes` long."""

    file: Path
    dtype: str  # safetensors code: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def dtype_name(self) -> str:
        """The torch name of the dtype ("bfloat16")."""
        return DTYPE_NAMES.get(self.dtype, self.dtype.lower())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, in the header's order, after the checks safetensors makes when it opens
    the file (a `ValueError` naming the file and the problem otherwise, on one line, whatever the bytes). A path that is
    not a regular file (a FIFO, a device) is refused without being opened."""
    path = Path(path)
    try:
        return _read_header(path)
    except _Invalid as error:
        raise InputError(f"{path}: not a valid safetensors file: {error}") from None


class _Invalid(Exception):
    pass


def _read_header(path: Path) -> dict[str, TensorInfo]:
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):
        raise _Invalid(f"{_kind(status.st_mode)}, not a regular file")
    size = status.st_size
    if size < 8:
        raise _Invalid(f"the file has {size} bytes, less than the 8-byte header length (empty or truncated)")
    with open(path, "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        if 8 + header_len > size:
            raise _Invalid(
                f"its header length ({header_len} bytes) runs past the end of the file ({size} bytes): truncated?"
            )
        if header_len > _MAX_HEADER:
            raise _Invalid(f"its header length ({header_len} bytes) is over safetensors' limit")
        raw = file.read(header_len)
    try:
        header = parse_json(raw, "header")
    except InputError as error:
        raise _Invalid(f"its header is not valid JSON {str(error).partition(': not valid JSON ')[2]}") from None
    if not isinstance(header, dict):
        raise _Invalid("its header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise _Invalid(f"its __metadata__ must map names to strings, got {_short(metadata)}")
    start = 8 + header_len
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            shape, code = tuple(entry["shape"]), entry["dtype"]
            if not all(_natural(n) for n in (begin, stop, *shape)) or not isinstance(code, str) or code not in _BYTES:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise _Invalid(
                f"tensor {_short(name)}: expected a dtype, a shape and data_offsets, got {_short(entry)}"
            ) from None
        nbytes = math.prod(shape) * _BYTES[code]
        if stop - begin != nbytes:
            raise _Invalid(
                f"tensor {_short(name)}: shape {_short(list(shape))} of {code} needs {nbytes} bytes but its "
                f"data_offsets [{begin}, {stop}] hold {stop - begin}"
            )
        tensors[name] = TensorInfo(path, code, shape, start + begin, nbytes)
        spans.append((begin, stop, name))
    end, data_size = max((stop for _, stop, _ in spans), default=0), size - start
    if end > data_size:
        raise _Invalid(f"its header describes {end} bytes of tensor data but the file holds {data_size}: truncated?")
    position = 0
    for begin, stop, name in sorted(spans):
        if begin != position:
            raise _Invalid(
                f"tensor {_short(name)}: data_offsets [{begin}, {stop}] overlap or leave a gap after byte {position}"
            )
        position = stop
    if end < data_size:
        raise _Invalid(f"{data_size - end} bytes after the last tensor the header describes")
    return tensors


def _natural(value) -> bool:
    """A JSON integer >= 0 (not a boolean: JSON's true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value, limit: int = 120) -> str:
    """repr(value) cut to `limit` characters: a message quotes a header's values, not megabytes of them."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def read_weights(folder: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in `folder` (one `model.safetensors`, or the shards its index lists), checked:
    headers that do not describe their file, an index naming a missing shard or a tensor its shard does not hold, and
    shards holding tensors the index does not list all raise `ValueError` / `FileNotFoundError` naming the file.

    Every file read must lie within `folder` (`io.file_within`: a Hub cache snapshot's links into its blobs are
    fine); a link out of the folder, a FIFO or a device is refused, naming it and what it is."""
    folder = Path(folder)
    index_path = folder / INDEX_NAME
    if os.path.lexists(index_path):
        _check_within(folder, index_path)
        weight_map = _read_index(index_path)
    elif os.path.lexists(folder / WEIGHTS_NAME):
        _check_within(folder, folder / WEIGHTS_NAME)
        return read_header(folder / WEIGHTS_NAME)
    else:
        others = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
        raise FileNotFoundError(f"{folder}: no {WEIGHTS_NAME} or {INDEX_NAME}{hint}")
    files = sorted(set(weight_map.values()))
    if missing_files := [file for file in files if not os.path.lexists(folder / file)]:
        raise FileNotFoundError(
            f"{index_path}: names shard {printable(missing_files[0])}, which does not exist in {folder}"
        )
    for file in files:
        if file_within(folder, folder / file) is None:
            raise InputError(
                f"{index_path}: names shard {printable(file)}, which is {why_skipped(folder, folder / file)}"
            )
    tensors = {}
    for file in files:
        path = folder / file
        stored = read_header(path)
        listed = {name for name, shard in weight_map.items() if shard == file}
        if missing := sorted(listed - stored.keys()):
            raise InputError(
                f"{index_path}: lists {_some(missing)} in {printable(file)}, but {path} does not contain it"
            )
        if extra := sorted(stored.keys() - listed):
            raise InputError(f"{path}: holds {_some(extra)}, which {index_path.name} does not list")
        tensors.update(stored)
    return tensors


def _check_within(folder: Path, path: Path) -> None:
    if file_within(folder, path) is None:
        raise InputError(f"{path}: {why_skipped(folder, path)}: not read")


def _read_index(index_path: Path) -> dict[str, str]:
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(
            f"{index_path}: not a safetensors index: expected a non-empty 'weight_map' from tensor names to shard "
            f"file names, got {_short(weight_map)}"
        )
    if bad := sorted({file for file in weight_map.values() if Path(file).name != file or file in (".", "..")}):
        raise InputError(f"{index_path}: shard names must be plain file names, got {_short(bad[0])}")
    return weight_map


def _some(names: list[str]) -> str:
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(printable(name, NAME_LIMIT) for name in names[:3]) + more


# --- writing -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shards:
    """Which tensors go in which file: huggingface_hub's plan, as `save_pretrained` makes it."""

    files: dict[str, list[str]]  # file name -> tensor names, in the order given
    index: dict | None  # the index file's content (None for a single `model.safetensors`)


def plan_shards(tensors: Mapping[str, tuple[str, tuple[int, ...]]], max_shard_size: int) -> Shards:
    """Shards of at most `max_shard_size` bytes for `tensors` ({name: (dtype code, shape)}), filled in order by
    huggingface_hub's `split_state_dict_into_shards_factory` (what `save_pretrained` uses: same files, same split)."""
    sizes = {name: math.prod(shape) * _BYTES[code] for name, (code, shape) in tensors.items()}
    plan = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda nbytes: nbytes, filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size
    )
    index = None
    if plan.is_sharded:
        total_parameters = sum(math.prod(shape) for _, shape in tensors.values())
        index = {
            "metadata": {**plan.metadata, "total_parameters": total_parameters},
            "weight_map": dict(sorted(plan.tensor_to_filename.items())),
        }
    return Shards(files=plan.filename_to_tensors, index=index)


def write_index(folder: Path, shards: Shards) -> list[Path]:
    """Write `model.safetensors.index.json` when the checkpoint is sharded; returns the files written."""
    if shards.index is None:
        return []
    (folder / INDEX_NAME).write_text(json.dumps(shards.index, indent=2) + "\n")
    return [folder / INDEX_NAME]


def build_header(tensors: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, dict]:
    """The first bytes of a safetensors file holding `tensors` ({name: (dtype code, shape)}) with `metadata`, exactly
    as safetensors' `serialize_file` writes them, and {name: offset of its data from the start of the file}.

    safetensors orders tensors by descending dtype, then name, writes compact JSON (UTF-8, not escaped) and pads it
    with spaces to a multiple of 8 bytes. (It keeps `metadata` in a hash map: with more than one key their order is not
    fixed, so only the order of the tensors is promised.)"""
    order = sorted(tensors, key=lambda name: (-DTYPE_CODES.index(tensors[name][0]), name))
    entries, offsets, end = {"__metadata__": dict(metadata)}, {}, 0
    for name in order:
        code, shape = tensors[name]
        nbytes = math.prod(shape) * _BYTES[code]
        entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [end, end + nbytes]}
        offsets[name] = end
        end += nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {name: start + offset for name, offset in offsets.items()}


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """`size` in bytes: an int, a string of digits (bytes), or a size like "5GB", "500MB", "1.5GB" (huggingface_hub's
    units: KB, MB, GB, TB, powers of 1000). Anything else, and sizes below one byte, raise a `ValueError` naming
    `name`."""
    try:
        if isinstance(size, int) and not isinstance(size, bool):
            value = size
        elif isinstance(size, str) and size.strip().isdigit():
            value = int(size.strip())
        else:
            value = parse_size_to_int(size)
    except (ValueError, TypeError, AttributeError, OverflowError):
        value = 0
    if value <= 0:
        raise ValueError(f"{name}: '{size}' is not a size like 5GB or 500MB")
    return value
