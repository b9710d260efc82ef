"""`hf-p2r export` (`hf_p2r.training.export.export_checkpoint`): a DCP training checkpoint as a Hugging Face folder.

The checkpoints are the trainer's own (`checkpoint_format: dcp`, L=4, k=1, delinked at step 2: checkpoint-2 holds
the pseudo model the trainer saves as pseudo/, checkpoint-4 the real model it saves as real/). The export of a
checkpoint is then byte for byte what the trainer and `hf-p2r convert` write from the same state: the trainer's
folder itself, or the converter's output from it (its model card aside, which names its source). Bad input is one
line, exit status 2, and nothing written."""

import filecmp
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from hf_p2r.checkpoint import convert_pseudo_to_real
from hf_p2r.cli import main
from hf_p2r.compat import dcp_reader
from hf_p2r.training import parse_config, train
from hf_p2r.training.export import export_checkpoint

from .helpers import tiny_argv

SCHEDULE = dict(pseudo_steps=2, real_steps=2, save_steps=1, checkpoint_format="dcp", eval_steps=0, remote_code=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("export") / "run"
    assert train(parse_config(tiny_argv(output_dir, **SCHEDULE))) == 0
    return output_dir


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("export_moe") / "run"
    assert train(parse_config(tiny_argv(output_dir, **SCHEDULE, num_experts=4, moe_intermediate_size=32))) == 0
    return output_dir


def same_files(a: Path, b: Path, *, but: tuple[str, ...] = ()) -> list[str]:
    """The files of `a` and `b` (the same names), each byte for byte equal, except those named in `but`."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    compared = [name for name in names if name not in but]
    assert filecmp.cmpfiles(a, b, compared, shallow=False) == (compared, [], [])
    return names


def test_a_checkpoint_exports_as_the_folder_the_trainer_saves(run, tmp_path):
    """checkpoint-2, kept pseudo (its own block count), is pseudo/; checkpoint-4 is real/: every file the same."""
    export_checkpoint(run / "checkpoints/checkpoint-2", tmp_path / "pseudo", num_unique_layers=1, progress=False)
    export_checkpoint(run / "checkpoints/checkpoint-4", tmp_path / "real", progress=False)
    assert "model.safetensors" in same_files(tmp_path / "pseudo", run / "pseudo")
    assert "modeling_p2r.py" in same_files(tmp_path / "real", run / "real")
    export_checkpoint(run, tmp_path / "newest", progress=False)  # a run's folder: its newest checkpoint, checkpoint-4
    same_files(tmp_path / "newest", run / "real")


@pytest.mark.parametrize(
    "checkpoint, source, options",
    [
        (2, "pseudo", {}),  # a pseudo checkpoint is delinked by default, as convert delinks pseudo/
        (4, "real", {"target": "llama"}),
        (4, "real", {"dtype": "bfloat16"}),
    ],
    ids=["delinked", "llama", "bfloat16"],
)
def test_a_conversion_is_what_convert_makes_of_the_trainers_folder(run, tmp_path, checkpoint, source, options):
    export_checkpoint(run / f"checkpoints/checkpoint-{checkpoint}", tmp_path / "exported", progress=False, **options)
    convert_pseudo_to_real(run / source, tmp_path / "converted", progress=False, **options)
    same_files(tmp_path / "exported", tmp_path / "converted", but=("README.md",))
    card = (tmp_path / "exported/README.md").read_text()
    assert f"source: checkpoint-{checkpoint}" in card  # the model card names the checkpoint


def test_the_llama_export_loads_with_transformers_and_gives_the_trained_models_logits(run, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(tmp_path / "llama"), "--target", "llama"]) == 0
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    trained = AutoModelForCausalLM.from_pretrained(run / "real", trust_remote_code=True).eval()
    ids = torch.randint(0, llama.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, trained(ids).logits, rtol=0, atol=0)


def test_a_moe_checkpoint_exports_as_p2r_and_mixtral(moe_run, tmp_path):
    """The DCP checkpoint holds the layers' 3-D experts; the folders hold save_pretrained's per-expert tensors."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(moe_run / "checkpoints/checkpoint-4").read_metadata().state_dict_metadata
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in saved
    export_checkpoint(moe_run / "checkpoints/checkpoint-4", tmp_path / "real", progress=False)
    same_files(tmp_path / "real", moe_run / "real")
    export_checkpoint(moe_run / "checkpoints/checkpoint-4", tmp_path / "mixtral", target="mixtral", progress=False)
    convert_pseudo_to_real(moe_run / "real", tmp_path / "converted", target="mixtral", progress=False)
    same_files(tmp_path / "mixtral", tmp_path / "converted", but=("README.md",))


def _damage(checkpoint: Path, case: str, tmp_path: Path) -> None:
    shard = checkpoint / "__0_0.distcp"
    if case == "truncated shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif case == "missing shard":
        shard.unlink()
    elif case == "link out of the folder":
        outside = tmp_path / "elsewhere.distcp"
        shutil.move(shard, outside)
        shard.symlink_to(outside)
    elif case == "trainer state linked out":
        outside = tmp_path / "elsewhere.json"
        shutil.move(checkpoint / "trainer_state.json", outside)
        (checkpoint / "trainer_state.json").symlink_to(outside)
    elif case == "not a DCP checkpoint":
        (checkpoint / ".metadata").unlink()
    elif case == "damaged metadata":
        (checkpoint / ".metadata").write_bytes(b"not a pickle")
    elif case == "no trainer state":
        (checkpoint / "trainer_state.json").unlink()
    elif case == "bad trainer state":
        (checkpoint / "trainer_state.json").write_text('{"state": {}, "config": {}}')
    elif case == "bad config field":
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        state["config"]["hidden_size"] = -8
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    elif case in ("metadata names a file out of the folder", "metadata names an absolute path"):
        outside = tmp_path / "elsewhere.distcp"
        shutil.move(shard, outside)
        named = "../elsewhere.distcp" if "out of" in case else str(outside)
        _rewrite_metadata(checkpoint, lambda metadata: [setattr(i, "relative_path", named) for i in _storage(metadata)])
    elif case == "a tensor half covered":
        _rewrite_metadata(checkpoint, _halve_embeddings)


def _storage(metadata) -> list:
    return list(metadata.storage_data.values())


def _rewrite_metadata(checkpoint: Path, change) -> None:
    metadata = dcp_reader(checkpoint).read_metadata()
    change(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _halve_embeddings(metadata) -> None:
    """The embeddings' one piece made to cover half its rows: what once exported uninitialised memory with exit 0."""
    entry = metadata.state_dict_metadata["model.model.embed_tokens.weight"]
    (chunk,) = entry.chunks
    entry.chunks = [ChunkStorageMetadata(chunk.offsets, torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]]))]


BAD = {
    "truncated shard": r"__0_0\.distcp: truncated \(\d+ bytes, \.metadata places pieces up to byte \d+\)",
    "missing shard": r"__0_0\.distcp: missing",
    "link out of the folder": r"__0_0\.distcp: refused: a link out of .* \(to .*elsewhere\.distcp\)",
    "trainer state linked out": r"trainer_state\.json: refused: a link out of .* \(to .*elsewhere\.json\)",
    "not a DCP checkpoint": r"checkpoint-4: not a DCP checkpoint \(no \.metadata",
    "damaged metadata": r"\.metadata: damaged \(UnpicklingError",
    "no trainer state": r"checkpoint-4: no trainer_state\.json",
    "bad trainer state": r'trainer_state\.json: "state\.blocks_consumed", .* missing',
    "bad config field": r'trainer_state\.json: "config": hidden_size: .*-8',
    # issue 36: a checkpoint names only its own files, and covers every tensor it holds
    "metadata names a file out of the folder": r"\.metadata: the storage entry of '.*' names '\.\./elsewhere\.distcp', "
    "a path out of the checkpoint's folder",
    "metadata names an absolute path": r"names '/.*elsewhere\.distcp', an absolute path",
    "a tensor half covered": r"tensor 'model\.model\.embed_tokens\.weight' of shape \[320, 32\]: its pieces cover "
    r"5120 of its 10240 elements",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(run, tmp_path, capsys, case):
    checkpoint = Path(shutil.copytree(run / "checkpoints/checkpoint-4", tmp_path / "checkpoint-4", symlinks=True))
    _damage(checkpoint, case, tmp_path)
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(tmp_path / "out" / "model")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("hf-p2r export: error: ")
    assert re.search(BAD[case], err), err
    assert not (tmp_path / "out").exists()


def test_an_existing_destination_is_kept_without_overwrite(run, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep.txt").write_text("mine")
    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(tmp_path / "out"), "--target", "llama"]) == 2
    assert "folder is not empty (overwrite=True, or --overwrite, replaces it)" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it
    # --overwrite replaces an earlier output of the command, never a folder of other files (issue 36)
    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(tmp_path / "out"), "--overwrite"]) == 2
    assert "out: holds keep.txt, which no model folder of hf-p2r holds; --overwrite replaces only an earlier" in (
        capsys.readouterr().err
    )
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    (tmp_path / "out/keep.txt").unlink()
    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(tmp_path / "out"), "--target", "llama"]) == 0
    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(tmp_path / "out"), "--overwrite"]) == 0
    same_files(tmp_path / "out", run / "real")


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (links too, as links): its bytes' hash and modification time."""
    return {
        str(path.relative_to(folder)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


# Issue 36: `hf-p2r export RUN RUN --overwrite` replaced the whole run (every checkpoint, the metrics) with the model.
DESTINATIONS = {
    "the run": lambda run: run,
    "inside the run": lambda run: run / "exported",
    "the checkpoint": lambda run: run / "checkpoints/checkpoint-4",
    "inside the checkpoint": lambda run: run / "checkpoints/checkpoint-4/model",
    "containing the run": lambda run: run.parent,
}


@pytest.mark.parametrize("case", DESTINATIONS)
@pytest.mark.parametrize("source", ["checkpoint", "run"])
def test_an_output_folder_is_never_the_inputs_home(run, tmp_path, capsys, case, source):
    copy = Path(shutil.copytree(run, tmp_path / "work" / "run"))
    before = snapshot(tmp_path)
    checkpoint = copy / "checkpoints/checkpoint-4" if source == "checkpoint" else copy
    assert main(["export", str(checkpoint), str(DESTINATIONS[case](copy)), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the output must not be the source" in err, err
    assert snapshot(tmp_path) == before


def test_overwrite_never_replaces_a_training_run(run, tmp_path, capsys):
    """Another run's output_dir, given as DST with --overwrite: refused in one line, every file kept."""
    other = Path(shutil.copytree(run, tmp_path / "other-run"))
    before = snapshot(other)
    assert main(["export", str(run / "checkpoints/checkpoint-4"), str(other), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"{other}: holds a training run (checkpoints, metrics.jsonl, train_config.yaml); --overwrite" in err, err
    assert snapshot(other) == before


def test_export_run_run_overwrite_as_users_type_it(run, tmp_path):
    """In a fresh process, with a timeout: exit 2, one line, the run as it was."""
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    before = snapshot(copy)
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "export", str(copy), str(copy), "--overwrite"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    source = copy / "checkpoints/checkpoint-4"  # (its newest checkpoint, and the run: both inputs)
    expected = f"hf-p2r export: error: {copy}: the output must not be the source {source}, inside it, or contain it"
    assert result.stderr == expected + "\n"
    assert snapshot(copy) == before


def test_a_conversion_the_converter_refuses_is_refused_first_naming_the_checkpoint(run, tmp_path, capsys):
    """The converter's own rules (`conversion_blocks`), applied before anything is written."""
    out = str(tmp_path / "out/model")
    assert (
        main(["export", str(run / "checkpoints/checkpoint-2"), out, "--target", "llama", "--num-unique-layers", "2"])
        == 2
    )
    needs = (
        "target='llama' needs the real model (one block per layer): num_unique_layers=2 is not num_hidden_layers (4)"
    )
    assert capsys.readouterr().err == f"hf-p2r export: error: {needs}\n"
    assert main(["export", str(run / "checkpoints/checkpoint-4"), out, "--num-unique-layers", "2"]) == 2
    state = run / "checkpoints/checkpoint-4/trainer_state.json"
    assert capsys.readouterr().err.startswith(f"hf-p2r export: error: {state}: share_layers is false")
    assert not list(tmp_path.iterdir())


def test_a_half_covered_tensor_is_exit_2_and_nothing_written_as_users_run_it(run, tmp_path):
    """What once wrote uninitialised memory (values like 1e38) and exited 0: in a fresh process, with a timeout."""
    checkpoint = Path(shutil.copytree(run / "checkpoints/checkpoint-4", tmp_path / "checkpoint-4"))
    _rewrite_metadata(checkpoint, _halve_embeddings)
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "export", str(checkpoint), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.count("\n") == 1 and re.search(BAD["a tensor half covered"], result.stderr), result.stderr
    assert not (tmp_path / "out").exists()
