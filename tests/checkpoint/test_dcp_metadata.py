"""A DCP checkpoint's `.metadata` is untrusted input (issue 36): every file it names must be a regular file within the
checkpoint's folder, every tensor must be tiled exactly by its pieces, and a load never leaves part of a tensor
unwritten (`hf_p2r.checkpoint.dcp_metadata`). Checked on small checkpoints that `dcp.save` writes in this process, on
hand-made and random (hypothesis) mutations of their metadata; a brute-force count of each tensor's elements is the
oracle for the tiling."""

import io
import itertools
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from hf_p2r.checkpoint.dcp_metadata import CoveringLoadPlanner, read_dcp_metadata, tiling_problem
from hf_p2r.compat import dcp_reader
from hf_p2r.errors import InputError

from ..security.payload import CraftedPickle

FULL = torch.arange(24.0).reshape(6, 4)


def save(folder: Path, state: dict) -> None:
    dcp.save(state, checkpoint_id=folder, no_dist=True)


def rewrite(folder: Path, change) -> None:
    """Apply `change` to the unpickled metadata of `folder` and write it back."""
    metadata = dcp_reader(folder).read_metadata()
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def two_pieces(folder: Path) -> None:
    """A checkpoint whose tensor "w" (FULL) is stored in two pieces, rows 0-2 and 3-5, as two processes write one
    (made from two tensors saved alone, their records merged), and a one-piece "b"."""
    save(folder, {"top": FULL[:3].clone(), "bottom": FULL[3:].clone(), "b": torch.arange(5.0)})

    def merge(metadata):
        entries, storage = metadata.state_dict_metadata, metadata.storage_data
        top = entries.pop("top")
        entries.pop("bottom")
        chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4]))]
        chunks.append(ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([3, 4])))
        entries["w"] = TensorStorageMetadata(properties=top.properties, size=torch.Size([6, 4]), chunks=chunks)
        storage[MetadataIndex("w", [0, 0])] = storage.pop(MetadataIndex("top", [0, 0]))
        storage[MetadataIndex("w", [3, 0])] = storage.pop(MetadataIndex("bottom", [0, 0]))

    rewrite(folder, merge)


def load(folder: Path, state: dict) -> dict:
    dcp.load(state, storage_reader=dcp_reader(folder), planner=CoveringLoadPlanner(), no_dist=True)
    return state


@pytest.fixture
def pieces(tmp_path) -> Path:
    two_pieces(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_tensor_in_two_pieces_reads_back_whole(pieces):
    """The control: the merged checkpoint is a valid one, and loads."""
    metadata = read_dcp_metadata(pieces)
    assert sorted(metadata.state_dict_metadata) == ["b", "w"]
    state = load(pieces, {"w": torch.zeros(6, 4), "b": torch.zeros(5)})
    assert torch.equal(state["w"], FULL) and torch.equal(state["b"], torch.arange(5.0))


def _set_path(relative):
    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = relative

    return change


def _chunks(*boxes):
    def change(metadata):
        entry = metadata.state_dict_metadata["w"]
        entry.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]

    return change


PATHS = {
    "parent": ("../elsewhere/__0_0.distcp", r"names '\.\./elsewhere/__0_0\.distcp', a path out of the checkpoint"),
    "inner parent": ("sub/../../__0_0.distcp", r"a path out of the checkpoint's folder"),
    "absolute": ("{outside}", r"an absolute path \(a checkpoint names only its own files\)"),
    "empty": ("", r"names '', not a file name"),
    "missing": ("gone.distcp", r"gone\.distcp: missing \(a shard of this DCP checkpoint"),
    "link out": ("link.distcp", r"link\.distcp: refused: a link out of .* \(\.metadata names it\)"),
    "fifo": ("fifo.distcp", r"fifo\.distcp: refused: a FIFO"),
    "folder": ("sub", r"sub: refused: a folder"),
    "newline": ("a\nb.distcp", r"a\\nb\.distcp: missing"),
}


@pytest.mark.parametrize("case", PATHS)
def test_every_file_metadata_names_is_a_regular_file_within_the_folder(pieces, tmp_path, case):
    """What resume once did with `../checkpoint-4/__0_0.distcp`: read another checkpoint's shard, then prune it."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(pieces / "__0_0.distcp", outside / "__0_0.distcp")
    (pieces / "link.distcp").symlink_to(outside / "__0_0.distcp")
    os.mkfifo(pieces / "fifo.distcp")
    (pieces / "sub").mkdir()
    relative, message = PATHS[case]
    rewrite(pieces, _set_path(relative.format(outside=outside / "__0_0.distcp")))
    with pytest.raises(InputError, match=message) as raised:
        read_dcp_metadata(pieces)
    assert "\n" not in str(raised.value) and str(pieces) in str(raised.value)


TILINGS = {
    "half": ([([0, 0], [3, 4])], r"tensor 'w' of shape \[6, 4\]: its pieces cover 12 of its 24 elements"),
    "overlap": (
        [([0, 0], [4, 4]), ([3, 0], [3, 4])],
        r"its pieces at \[0, 0\] \(size \[4, 4\]\) and \[3, 0\] \(size \[3, 4\]\) overlap",
    ),
    "outside": ([([0, 0], [3, 4]), ([3, 0], [4, 4])], r"a piece at \[3, 0\] of size \[4, 4\] reaches outside"),
    "dimensions": ([([0], [24])], r"a piece at \[0\] of size \[24\] does not have the tensor's 2 dimensions"),
    "no storage": ([([0, 0], [3, 4]), ([3, 0], [1, 4]), ([4, 0], [2, 4])], r"piece at \[4, 0\] has no storage"),
}


@pytest.mark.parametrize("case", TILINGS)
def test_every_tensor_is_tiled_exactly_by_its_pieces(pieces, case):
    """What export once did with a piece covering half a tensor: write the other half's uninitialised memory."""
    boxes, message = TILINGS[case]
    rewrite(pieces, _chunks(*boxes))  # ("no storage": rows 3-5 in two pieces, [3, 0] has a storage entry, [4, 0] none)
    with pytest.raises(InputError, match=message):
        read_dcp_metadata(pieces)


@pytest.mark.parametrize("case", ["half", "overlap"])
def test_the_load_itself_refuses_a_plan_that_leaves_a_tensor_partly_unwritten(pieces, case):
    """`CoveringLoadPlanner`, without the metadata check before it: refused before any byte is read (the tensor
    loaded into keeps what it held)."""
    rewrite(pieces, _chunks(*TILINGS[case][0]))
    target = torch.full((6, 4), -7.0)
    with pytest.raises(BaseException, match=r"w: not wholly in the checkpoint: its pieces"):  # (DCP's exception)
        load(pieces, {"w": target})
    assert torch.equal(target, torch.full((6, 4), -7.0))


def test_a_metadata_file_that_is_a_link_out_of_the_folder_is_not_read(pieces, tmp_path):
    shutil.move(pieces / ".metadata", tmp_path / "elsewhere.metadata")
    (pieces / ".metadata").symlink_to(tmp_path / "elsewhere.metadata")
    with pytest.raises(InputError, match=r"\.metadata: refused: a link out of"):
        read_dcp_metadata(pieces)


def test_pickled_values_another_library_loads_must_load_with_weights_only(tmp_path):
    """Accelerate's FSDP optimizer folders hold pickled values (parameter groups), which DCP loads with
    `torch.load(weights_only=False)`: checked with `weights_only=True` first, so a crafted one never runs."""
    folder = tmp_path / "optimizer_0"
    save(folder, {"state": torch.ones(3), "param_groups": [{"lr": 0.1, "params": [0]}]})
    with pytest.raises(InputError, match=r"BytesStorageMetadata is not part of a DCP checkpoint's metadata"):
        read_dcp_metadata(folder)  # hf-p2r's own checkpoints hold tensors only
    read_dcp_metadata(folder, bytes_entries=True)  # plain values: fine

    buffer = io.BytesIO()
    torch.save(CraftedPickle(tmp_path / "ran"), buffer)
    metadata = dcp_reader(folder, bytes_entries=True).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.offset is None)  # a pickled value
    shard = folder / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(buffer.getvalue())
    with open(shard, "ab") as file:
        file.write(buffer.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(InputError, match=r"holds objects other than tensors and plain containers"):
        read_dcp_metadata(folder, bytes_entries=True)
    assert not (tmp_path / "ran").exists()


def test_a_key_with_control_characters_is_shown_escaped(pieces):
    def rename(metadata):
        entry = metadata.state_dict_metadata.pop("w")
        entry.chunks = entry.chunks[:1]
        metadata.state_dict_metadata["w\nforged: line"] = entry

    rewrite(pieces, rename)
    with pytest.raises(InputError, match=r"tensor 'w\\nforged: line' of shape") as raised:
        read_dcp_metadata(pieces)
    assert "\n" not in str(raised.value)


# --- tiling_problem against a brute-force count of each element ------------------------------------------------------


def _counts(shape, boxes) -> dict:
    """How many of `boxes` hold each element of a tensor of `shape` (elements outside it under key None)."""
    counts = dict.fromkeys(itertools.product(*(range(n) for n in shape)), 0)
    for offsets, sizes in boxes:
        for element in itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))):
            key = element if element in counts else None
            counts[key] = counts.get(key, 0) + 1
    return counts


def _inside(shape, boxes) -> bool:
    """Every box (even an empty one) within `shape`."""
    return all(o + s <= n for offsets, sizes in boxes for o, s, n in zip(offsets, sizes, shape))


SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3)


@st.composite
def shapes_and_boxes(draw):
    shape = draw(SHAPES)
    box = st.tuples(st.tuples(*(st.integers(0, 5) for _ in shape)), st.tuples(*(st.integers(0, 5) for _ in shape)))
    return shape, draw(st.lists(box, max_size=5))


@settings(max_examples=150, deadline=None)
@given(shapes_and_boxes())
def test_tiling_problem_agrees_with_a_count_of_every_element(case):
    shape, boxes = case
    counts = _counts(shape, boxes)
    exact = (
        _inside(shape, boxes) and counts.get(None, 0) == 0 and all(c == 1 for k, c in counts.items() if k is not None)
    )
    assert (tiling_problem(shape, boxes) is None) == exact, (shape, boxes, counts)


@st.composite
def partitions(draw):
    """A shape and a tiling of it by guillotine cuts (each piece split along one dimension, or kept)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    pieces, done = [((0,) * len(shape), shape)], []
    for _ in range(draw(st.integers(0, 6))):
        if not pieces:
            break
        offsets, sizes = pieces.pop(draw(st.integers(0, len(pieces) - 1)))
        axis = draw(st.integers(0, len(shape) - 1))
        if sizes[axis] < 2:
            done.append((offsets, sizes))
            continue
        cut = draw(st.integers(1, sizes[axis] - 1))
        first = tuple(cut if d == axis else s for d, s in enumerate(sizes))
        second_offsets = tuple(o + cut if d == axis else o for d, o in enumerate(offsets))
        second = tuple(s - cut if d == axis else s for d, s in enumerate(sizes))
        pieces += [(offsets, first), (second_offsets, second)]
    return shape, pieces + done


@settings(max_examples=100, deadline=None)
@given(partitions(), st.data())
def test_a_partition_tiles_and_any_piece_dropped_or_repeated_does_not(partition, data):
    shape, boxes = partition
    assert tiling_problem(shape, boxes) is None
    index = data.draw(st.integers(0, len(boxes) - 1))
    assert "cover" in tiling_problem(shape, boxes[:index] + boxes[index + 1 :])
    assert "overlap" in tiling_problem(shape, [*boxes, boxes[index]])


# --- random mutations of a real checkpoint's metadata ----------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    two_pieces(folder)
    return folder


PATH_CHOICES = ["__0_0.distcp", "../__0_0.distcp", "/etc/hostname", "", "gone.distcp", "link.distcp", "x/../y"]
MUTATIONS = st.one_of(
    st.tuples(st.just("path"), st.integers(0, 2), st.sampled_from(PATH_CHOICES) | st.text(max_size=8)),
    st.tuples(st.just("offset"), st.integers(0, 2), st.integers(-2, 10**7) | st.booleans()),
    st.tuples(st.just("length"), st.integers(0, 2), st.integers(-2, 10**7)),
    st.tuples(
        st.just("chunks"),
        st.lists(
            st.tuples(st.tuples(st.integers(0, 7), st.integers(0, 4)), st.tuples(st.integers(0, 7), st.integers(0, 5))),
            max_size=3,
        ),
    ),
    st.tuples(st.just("size"), st.tuples(st.integers(0, 8), st.integers(0, 5))),
)


def _mutate(metadata, mutation) -> None:
    kind, *args = mutation
    storage = list(metadata.storage_data.values())
    if kind in ("path", "offset", "length"):
        index, value = args
        setattr(storage[index % len(storage)], {"path": "relative_path"}.get(kind, kind), value)
    elif kind == "chunks":
        (boxes,) = args
        metadata.state_dict_metadata["w"].chunks = [
            ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes
        ]
    else:
        metadata.state_dict_metadata["w"].size = torch.Size(args[0])


def _valid(folder: Path, metadata) -> bool:
    """The oracle: every storage entry a plain name of a regular file of `folder` long enough for its pieces, every
    tensor covered once by its pieces (a brute-force count), every non-empty piece with its storage entry."""
    for info in metadata.storage_data.values():
        natural = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length))
        path = folder / info.relative_path if info.relative_path else None
        if not (natural and info.relative_path == "__0_0.distcp" and path.is_file()):
            return False
        if info.offset + info.length > path.stat().st_size:
            return False
    for key, entry in metadata.state_dict_metadata.items():
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        if any(len(o) != len(entry.size) or len(s) != len(entry.size) for o, s in boxes):
            return False
        counts = _counts(tuple(entry.size), boxes)
        if (
            not _inside(tuple(entry.size), boxes)
            or counts.get(None, 0)
            or any(count != 1 for k, count in counts.items() if k is not None)
        ):
            return False
        if any(math.prod(s) and MetadataIndex(key, o) not in metadata.storage_data for o, s in boxes):
            return False
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(MUTATIONS, min_size=1, max_size=3))
def test_random_mutations_are_refused_in_one_line_exactly_when_they_name_or_cover_wrongly(base, mutations):
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name) / "ckpt"
        shutil.copytree(base, folder)
        (folder / "link.distcp").symlink_to(base / "__0_0.distcp")  # a link out of `folder`
        metadata = dcp_reader(folder).read_metadata()
        for mutation in mutations:
            _mutate(metadata, mutation)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        expected = _valid(folder, metadata)
        event("valid" if expected else "invalid")
        try:
            read_dcp_metadata(folder)
        except InputError as error:
            assert not expected, f"refused a valid checkpoint: {error}"
            assert "\n" not in str(error) and str(folder) in str(error)
        else:
            assert expected, "accepted an invalid checkpoint"
