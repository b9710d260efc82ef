"""`save_model_from_shards` (hf_p2r.checkpoint.sharded_write) on two CPU processes (gloo), and four for
data-parallel sharded pipeline stages: the folder written from a 2-stage pipeline's stages and from FSDP2 shards
equals the folder `save_model` writes from the gathered state dict (every file byte for byte, so every tensor bit for
bit) and loads with `from_pretrained`; and the peak memory of the write (VmHWM above the resident size before it, not
a timing) stays far below the whole model's bytes, where the gathered write's first process holds the whole state
dict.
"""

import errno
import filecmp
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hf_p2r import P2RForCausalLM
from hf_p2r.checkpoint import save_model, sharded_write
from hf_p2r.checkpoint.sharded_write import assign_writers, save_model_from_shards
from hf_p2r.distributed import fully_shard_p2r
from hf_p2r.distributed.pipeline import build_pipeline, gather_state_dict, pipeline_mesh, pipeline_model_config
from hf_p2r.models.p2r import P2RMoeForCausalLM
from hf_p2r.training import parse_config, train
from hf_p2r.training.engines.accelerate import AccelerateEngine

from ..conftest import tiny_config
from ..distributed import spawn
from ..models.test_modeling_p2r_moe import moe_config
from ..training.helpers import tiny_argv

PATTERNS = {
    "real": {},
    "cycle": dict(share_layers=True, num_unique_layers=2, sharing_pattern="cycle"),
    "tied": dict(tie_word_embeddings=True),
}
SMALL_SHARDS = 20_000  # bytes: a tiny model in several files and an index
SEQ = 16


def model_of(pattern: str, **overrides) -> P2RForCausalLM:
    torch.manual_seed(0)
    return P2RForCausalLM(tiny_config(num_hidden_layers=4, **PATTERNS[pattern], **overrides)).train()


def train_steps(params, step, batches: int = 2) -> None:
    """A few AdamW steps, so that the weights written are not the initialisation."""
    optimizer = torch.optim.AdamW(list(params), lr=1e-2)
    for seed in range(batches):
        step(torch.randint(0, 101, (4, SEQ), generator=torch.Generator().manual_seed(seed)))
        optimizer.step()
        optimizer.zero_grad()


def same_folders(first: Path, second: Path, model_class=P2RForCausalLM) -> dict:
    """{files: the two folders' file names equal, bytes: every file equal byte for byte, tensors: every tensor of
    the loaded models equal (torch.equal)}."""
    names = sorted(path.name for path in first.iterdir())
    out = {"files": names == sorted(path.name for path in second.iterdir()), "count": len(names)}
    out["bytes"] = out["files"] and all(filecmp.cmp(first / name, second / name, shallow=False) for name in names)
    one, other = model_class.from_pretrained(first), model_class.from_pretrained(second)
    weights = other.state_dict()
    out["tensors"] = all(torch.equal(tensor, weights[name]) for name, tensor in one.state_dict().items())
    return out


def pipeline_folders(folder: str) -> dict:
    """A 2-stage 1F1B pipeline trained two steps: its folder written from the stages against the gathered write."""
    out = {}
    for pattern in PATTERNS:
        for shard_size in ("5GB", SMALL_SHARDS):
            pipeline = build_pipeline(model_of(pattern), schedule="1f1b", num_microbatches=2, seq_len=SEQ)
            train_steps(pipeline.parameters(), pipeline.step)
            with torch.device("meta"):
                skeleton = P2RForCausalLM(pipeline_model_config(pipeline))
            cooperative, gathered = Path(f"{folder}/{pattern}-{shard_size}"), Path(f"{folder}/{pattern}-{shard_size}-g")
            save_model_from_shards(
                skeleton, cooperative, dict(pipeline.named_parameters()), max_shard_size=shard_size, progress=False
            )
            weights = gather_state_dict(pipeline)
            if weights is not None:
                save_model(skeleton, gathered, state_dict=weights, max_shard_size=shard_size, progress=False)
                out[f"{pattern}/{shard_size}"] = same_folders(cooperative, gathered)
            dist.barrier()
    return out


def fsdp2_engine(model) -> SimpleNamespace:
    """A stand-in Accelerate engine whose accelerator reports FSDP2 (on CPU Accelerate turns FSDP off): what
    `AccelerateEngine.save_model` reads of its engine."""
    accelerator = SimpleNamespace(is_fsdp2=True, unwrap_model=lambda module: module)
    return SimpleNamespace(accelerator=accelerator, model=model, remote_code=False)


def fsdp2_folders(folder: str) -> dict:
    """FSDP2 over two processes (vocab 101: uneven shards of 51 and 50 rows), one AdamW step: the folder written from
    the shards against `save_model` of the gathered (full_tensor) state dict."""
    out = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for pattern in PATTERNS:
        model = fully_shard_p2r(model_of(pattern), mesh=mesh)
        train_steps(model.parameters(), lambda ids, model=model: model(input_ids=ids, labels=ids).loss.backward(), 1)
        cooperative, gathered = Path(f"{folder}/fsdp-{pattern}"), Path(f"{folder}/fsdp-{pattern}-g")
        save_model_from_shards(model, cooperative, model.state_dict(), max_shard_size=SMALL_SHARDS, progress=False)
        full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
        if dist.get_rank() == 0:
            save_model(model, gathered, state_dict=full, max_shard_size=SMALL_SHARDS, progress=False)
            out[pattern] = same_folders(cooperative, gathered)
        dist.barrier()
    # The Accelerate engine's FSDP2 branch (on CPU Accelerate turns FSDP off, so its `save_model` is called on a
    # stand-in engine whose accelerator reports FSDP2) against the gathered write of one shard size.
    AccelerateEngine.save_model(fsdp2_engine(model), Path(f"{folder}/fsdp-engine"), tokenizer=None)
    if dist.get_rank() == 0:
        save_model(model, f"{folder}/fsdp-engine-g", state_dict=full, progress=False)
        out["engine"] = same_folders(Path(f"{folder}/fsdp-engine"), Path(f"{folder}/fsdp-engine-g"))
    dist.barrier()
    return out


def fsdp2_moe_folders(folder: str) -> dict:
    """MoE models under FSDP2 over two processes (4 experts: 2 each; 3: 2 and 1, FSDP2's uneven split), one AdamW
    step: the Accelerate engine's FSDP2 branch, whose processes write their own experts one tensor per expert under
    Mixtral's names, against `save_model` of the gathered state dict (which reverts the 3-D experts itself); and the
    experts' tensors each process passed (`saved_pieces`): those of its own experts only."""
    out = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for experts in (4, 3):
        torch.manual_seed(0)
        model = fully_shard_p2r(
            P2RMoeForCausalLM(moe_config(num_experts=experts, num_hidden_layers=2)).train(), mesh=mesh
        )
        train_steps(model.parameters(), lambda ids, model=model: model(input_ids=ids, labels=ids).loss.backward(), 1)
        cooperative, gathered = Path(f"{folder}/moe-{experts}"), Path(f"{folder}/moe-{experts}-g")
        AccelerateEngine.save_model(fsdp2_engine(model), cooperative, tokenizer=None)
        _, pieces = sharded_write.saved_pieces(model, model.state_dict())
        mine = sorted({int(name.split(".experts.")[1].split(".")[0]) for name in pieces if ".experts." in name})
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, mine)
        full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
        if dist.get_rank() == 0:
            save_model(model, gathered, state_dict=full, progress=False)
            out[experts] = {**same_folders(cooperative, gathered, P2RMoeForCausalLM), "held": held}
        dist.barrier()
    return out


def peak_above_resident(action) -> int:
    """Bytes the process's peak resident size (VmHWM, reset first) rose above its resident size during `action`."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    action()
    return _status("VmHWM") - before


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def peak_memory(folder: str) -> dict:
    """A 2-stage pipeline of a ~100 MB fp32 model: each process's peak memory above its resident size while writing
    the folder from its stages, and while the gathered write runs (the first process gathers and writes)."""
    config = dict(vocab_size=16000, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=8)  # fmt: skip
    pipeline = build_pipeline(model_of("real", **config), schedule="1f1b", num_microbatches=2, seq_len=SEQ)
    with torch.device("meta"):
        skeleton = P2RForCausalLM(pipeline_model_config(pipeline))
    model_bytes = sum(t.numel() * t.element_size() for t in skeleton.state_dict().values())
    mine = dict(pipeline.named_parameters())
    held = sum(t.numel() * t.element_size() for t in mine.values())
    dist.barrier()
    cooperative = peak_above_resident(
        lambda: save_model_from_shards(skeleton, f"{folder}/big", mine, progress=False),
    )

    def gathered_write():
        weights = gather_state_dict(pipeline)
        if weights is not None:
            save_model(skeleton, f"{folder}/big-g", state_dict=weights, progress=False)
        dist.barrier()

    gathered = peak_above_resident(gathered_write)
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, {"held": held, "cooperative": cooperative, "gathered": gathered})
    return {"model_bytes": model_bytes, "processes": figures}


def failures_on_every_process(folder: str) -> dict:
    """Two failures, each told on both processes in one line: a destination that is not empty (no overwrite: the
    first process refuses it before any file exists) and a full disk while the second process writes its rows (its
    `write_tensor` made to fail with ENOSPC); nothing is left beside the destinations."""
    destination = Path(f"{folder}/taken")
    if dist.get_rank() == 0:
        destination.mkdir()
        (destination / "keep.txt").write_text("mine")
    dist.barrier()
    pipeline = build_pipeline(model_of("real"), schedule="1f1b", num_microbatches=2, seq_len=SEQ)
    with torch.device("meta"):
        skeleton = P2RForCausalLM(pipeline_model_config(pipeline))
    out = {}
    for case, target in (("taken", destination), ("full", Path(f"{folder}/full"))):
        original = sharded_write.write_tensor
        if case == "full" and dist.get_rank() == 1:

            def write_tensor(fd, *args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            sharded_write.write_tensor = write_tensor
        try:
            save_model_from_shards(skeleton, target, dict(pipeline.named_parameters()), progress=False)
            error = None
        except (OSError, RuntimeError) as failure:
            error = f"{type(failure).__name__}: {failure}"
        finally:
            sharded_write.write_tensor = original
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        out[case] = errors
    out["left"] = sorted(path.name for path in Path(folder).iterdir() if path.name.startswith((".taken", ".full")))
    out["full_exists"] = Path(f"{folder}/full").exists()
    return out


def trainer_real_folder(folder: str) -> dict:
    """The pipelined trainer (2 stages, 1F1B, delinked at step 1): real/ written from the stages, against the
    final checkpoint's stage files (each process's weights)."""
    output_dir = f"{folder}/run"
    fields = dict(pipeline_schedule="1f1b", num_microbatches=2, shared_lr_scale="none", num_unique_layers=2)
    fields.update(checkpoint_format="accelerate")  # stage files, read below (dcp: the default of several processes)
    argv = tiny_argv(output_dir, pipeline_parallel_size=2, pseudo_steps=1, real_steps=1, eval_steps=0, **fields)
    assert train(parse_config(argv)) == 0
    if dist.get_rank() != 0:
        return {}
    stages = {}
    for part in sorted(Path(output_dir, "checkpoints", "checkpoint-2").glob("stage-*.pt")):
        stages.update(torch.load(part, weights_only=True)["weights"])
    real = P2RForCausalLM.from_pretrained(f"{output_dir}/real")
    weights = real.state_dict()
    return {
        "names": sorted(stages) == sorted(name for name in weights if name != "lm_head.weight" or name in stages),
        "equal": all(torch.equal(tensor, weights[name]) for name, tensor in stages.items()),
        "pseudo_blocks": P2RForCausalLM.from_pretrained(f"{output_dir}/pseudo").config.num_unique_layers,
    }


def data_parallel_folders(folder: str) -> dict:
    """Two pipelines of two FSDP2-sharded stages (4 processes, 2-D mesh): a cycle model's shared blocks are held by
    both stages of a pipeline and split over the data-parallel column, so each range of rows is held by two processes
    and written by one; against the gathered write."""
    mesh = pipeline_mesh(pipeline_parallel_size=2, data_parallel_size=2)
    out = {}
    for pattern in ("real", "cycle"):
        pipeline = build_pipeline(model_of(pattern), schedule="1f1b", num_microbatches=2, seq_len=SEQ, mesh=mesh,
                                  shard=True)  # fmt: skip
        train_steps(
            pipeline.parameters(), lambda ids, pipeline=pipeline: pipeline.step(ids.chunk(2)[pipeline.data_rank])
        )
        with torch.device("meta"):
            skeleton = P2RForCausalLM(pipeline_model_config(pipeline))
        cooperative, gathered = Path(f"{folder}/dp-{pattern}"), Path(f"{folder}/dp-{pattern}-g")
        save_model_from_shards(skeleton, cooperative, dict(pipeline.named_parameters()), max_shard_size=SMALL_SHARDS,
                               progress=False)  # fmt: skip
        weights = gather_state_dict(pipeline)  # whole weights: a collective over each column, then the pipeline's
        if dist.get_rank() == 0:
            save_model(skeleton, gathered, state_dict=weights, max_shard_size=SMALL_SHARDS, progress=False)
            out[pattern] = same_folders(cooperative, gathered)
        dist.barrier()
    return out


def four_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return data_parallel_folders(folder)


def two_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return {
        "pipeline": pipeline_folders(folder),
        "fsdp2": fsdp2_folders(folder),
        "moe": fsdp2_moe_folders(folder),
        "memory": peak_memory(folder),
        "failures": failures_on_every_process(folder),
        "trainer": trainer_real_folder(folder),
    }


two = spawn.shared_run(two_processes, 2)
four = spawn.shared_run(four_processes, 4)


@pytest.mark.parametrize("pattern", ["real", "cycle"])
def test_data_parallel_sharded_stages_write_the_gathered_folder(four, pattern):
    result = four[pattern]
    assert result["files"] and result["bytes"] and result["tensors"], result


@pytest.mark.parametrize("case", [f"{p}/{s}" for p in PATTERNS for s in ("5GB", SMALL_SHARDS)])
def test_a_pipelines_folder_written_from_its_stages_equals_the_gathered_write(two, case):
    result = two["pipeline"][case]
    assert result["files"] and result["bytes"] and result["tensors"], result
    assert result["count"] > (4 if case.endswith(str(SMALL_SHARDS)) else 1)  # the small case: shards and an index


@pytest.mark.parametrize("pattern", [*PATTERNS, "engine"])
def test_a_folder_written_from_fsdp2_shards_equals_the_gathered_write(two, pattern):
    result = two["fsdp2"][pattern]
    assert result["files"] and result["bytes"] and result["tensors"], result


@pytest.mark.parametrize("experts", [4, 3])
def test_a_moe_folder_written_from_fsdp2_shards_equals_the_gathered_write(two, experts):
    """Each process writes the experts it holds (FSDP2 shards the 3-D experts by expert) under Mixtral's names: the
    folder is the gathered write's, byte for byte, and no process passed another's experts."""
    result = two["moe"][str(experts)]
    assert result["files"] and result["bytes"] and result["tensors"], result
    assert result["held"] == ([[0, 1], [2, 3]] if experts == 4 else [[0, 1], [2]])


def test_no_process_holds_the_whole_state_dict_while_writing(two):
    """Each process writes from the tensors it holds: its peak rises by far less than the model (measured: see the
    report), where the gathered write's first process holds the whole state dict (its peak rises by more than the
    model's bytes)."""
    memory = two["memory"]
    model_bytes = memory["model_bytes"]
    assert model_bytes > 90e6
    for figures in memory["processes"]:
        assert figures["held"] < 0.7 * model_bytes  # each process holds one stage
        assert figures["cooperative"] < 0.1 * model_bytes, figures
    assert memory["processes"][0]["gathered"] > 0.5 * model_bytes, memory


def test_writers_are_assigned_once_per_range_and_gaps_are_refused():
    held = [
        {"a": ("float32", (5, 2), (0, 3)), "b": ("float32", (4,), (0, 4))},
        {"a": ("float32", (5, 2), (3, 5)), "b": ("float32", (4,), (0, 4))},
    ]
    specs, writers = assign_writers(held)
    assert specs == {"a": ("float32", (5, 2)), "b": ("float32", (4,))}
    assert writers == {("a", (0, 3)): 0, ("a", (3, 5)): 1, ("b", (0, 4)): 0}
    held[1]["a"] = ("float32", (5, 2), (4, 5))
    with pytest.raises(ValueError, match=r"^a: no process holds rows 3 to 4 of its 5$"):
        assign_writers(held)
    held[1]["a"] = ("bfloat16", (5, 2), (3, 5))
    with pytest.raises(ValueError, match=r"^a: processes hold it as"):
        assign_writers(held)


def test_a_failure_on_one_process_is_one_line_on_every_process_and_leaves_nothing(two):
    failures = two["failures"]
    first, second = failures["taken"]
    assert first.startswith("FileExistsError: ") and "folder is not empty" in first
    assert second.startswith("OSError: ") and "taken: not written, process 0 failed: " in second
    assert "folder is not empty" in second
    first, second = failures["full"]
    assert second.startswith("OSError: [Errno 28] No space left on device: ")  # naming its file
    assert second.split(": ")[-1].strip("'").endswith(".safetensors")
    assert first.startswith("OSError: ") and "full: not written, process 1 failed: [Errno 28]" in first
    assert failures["left"] == [] and not failures["full_exists"]  # no temporary folder, no partial destination


def test_the_pipelined_trainer_writes_pseudo_and_real_from_its_stages(two):
    trainer = two["trainer"]
    assert trainer["names"] and trainer["equal"]
    assert trainer["pseudo_blocks"] == 2
