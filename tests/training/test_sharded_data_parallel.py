"""Sharded data parallelism without a pipeline (`pipeline_parallel_size: 1`, `data_parallel_size: N`,
`data_parallel_shard: true`): the whole model one stage, FSDP2-sharded N ways by the pipeline engine itself, on CPU
processes (gloo) as on GPUs.

Through the trainer, pseudo -> delink -> real with DCP checkpoints, 2 processes: the losses, gradient norms and
validation losses equal one process on the same global batch (tolerance measured), with 2 micro-batches per process
(gradient accumulation) and replicated (`data_parallel_shard: false`) too, each process holds DTensor shards
(not the whole model) and checkpoints them as halves, `pseudo/` and `real/` equal the one-process folders, and the
DCP checkpoint resumes sharded (bitwise), replicated, on one process and on 4 sharded processes (slow), where a fresh
4-process run also equals one process. The one-stage step runs the stage directly (`AccumulateSchedule`), so FSDP2
keeps only a block or two unsharded at once, where torch's one-stage 1F1B holds every block unsharded, and gathers a
shared block once per step; pipelines of sharded stages (2 x 2) likewise reshard and reduce-scatter after each
micro-batch's backward (`ShardedPipelineStage`), where torch's `PipelineStage` defers both to the step's end.
Refusals are one line naming the field.
"""

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from hf_p2r import P2RForCausalLM
from hf_p2r.compat import local_tensor
from hf_p2r.distributed.pipeline import build_pipeline, causal_lm_loss, delink_stages, pipeline_mesh
from hf_p2r.training import parse_config, train
from hf_p2r.training.engines import engine_for

from ..conftest import tiny_config
from ..distributed import spawn
from .helpers import tiny_argv, trajectory

# L=4, k=1: pseudo steps 1-2, the delink to the real model at step 2, real steps 3-4; a DCP checkpoint every step, a
# validation every 2 steps (through the stage: `Pipeline.evaluate`). Global batch: 4 blocks.
SCHEDULE = dict(pseudo_steps=2, real_steps=2, save_steps=1, checkpoint_format="dcp")
SHARDED = dict(SCHEDULE, data_parallel_size=2, data_parallel_shard="true", per_device_batch_size=2)
FOUR = dict(SHARDED, data_parallel_size=4, per_device_batch_size=1)
KEYS = ("loss", "grad_norm", "val_loss")
# Measured against one process on the same global batch (2 processes): losses differ by at most 8.8e-8 (relative; the
# mean of the processes' token means against one mean, FSDP2's averaging reduce-scatter against one backward),
# gradient norms by 1.9e-7, validation losses not at all; the one-process resumes of the 2-process checkpoints alike.
# 2 micro-batches per process: the same figures. 4 processes: losses 0, gradient norms 1.9e-7, validation losses
# 8.5e-8 from one process; the 2-process checkpoints resumed on 4: bitwise after the delink (3), within 8.8e-8 before
# it (1).
TOLERANCE = dict(rtol=1e-6, atol=0.0)
# Measured: the weights of `pseudo/` differ from the one-process folder's by at most 3.6e-8, those of `real/` by 1.2e-7
# (a third of the elements in their last bits; weights of magnitude up to 1).
WEIGHTS_TOLERANCE = dict(rtol=0.0, atol=1e-6)


def values(output_dir, key: str) -> list[float]:
    return [record[key] for record in trajectory(output_dir) if key in record]


def assert_same_run(got: Path, want: Path, **tolerance) -> None:
    for key in KEYS:
        got_values, want_values = values(got, key), values(want, key)
        assert len(got_values) == len(want_values) > 0, key
        torch.testing.assert_close(got_values, want_values, **(tolerance or dict(rtol=0.0, atol=0.0)))


def run(output_dir: Path, checkpoint: int | None = None, source: Path | None = None, **fields) -> None:
    """The trainer into `output_dir` (with `checkpoint`: a copy of `source` resumed from its checkpoint)."""
    if source is not None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.copytree(source, output_dir)
        if dist.is_initialized():
            dist.barrier()
        fields["resume_from_checkpoint"] = f"{output_dir}/checkpoints/checkpoint-{checkpoint}"
    assert train(parse_config(tiny_argv(output_dir, **fields))) == 0
    if dist.is_initialized():
        dist.barrier()


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def shard_layout(world: int) -> dict:
    """{name: (parameter type, dim 0 of every process's local shard, the whole tensor's shape)} of the whole model as
    one stage built on the meta device and sharded over `world` processes (only the local shards materialised)."""
    with torch.device("meta"):
        model, whole = P2RForCausalLM(tiny_config()), dict(P2RForCausalLM(tiny_config()).named_parameters())
    pipeline = build_pipeline(model, schedule="1f1b", num_microbatches=1, seq_len=16, mesh=pipeline_mesh(1, world),
                              shard=True, seed=0)  # fmt: skip
    mine = {name: (type(param).__name__, local_tensor(param).shape[0]) for name, param in pipeline.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return {
        name: (kind, [part[name][1] for part in gathered], list(whole[name].shape)) for name, (kind, _) in mine.items()
    }


def watch_gathered(blocks: list) -> Callable[[], int]:
    """Hooks on `blocks` counting how many are gathered (FSDP2 swaps a gathered unit's DTensor parameters for whole
    ones) at each block's output and, in the backward, once its output's gradient is known; returns the most seen."""
    most = 0

    def count(*_):
        nonlocal most
        most = max(most, sum(not isinstance(block.mlp.up_proj.weight, DTensor) for block in blocks))

    def on_output(module, args, output):
        count()
        if output.requires_grad:
            output.register_hook(count)

    for block in blocks:
        block.register_forward_hook(on_output)
    return lambda: most


def unsharded_blocks(direct: bool) -> int:
    """The most blocks of an 8-block model, one stage sharded over the processes, whose weights are gathered at once
    during a step of 2 micro-batches: run directly (`AccumulateSchedule`, what the trainer runs) or by torch's
    one-stage 1F1B on its own `PipelineStage`. FSDP2 swaps a unit's sharded DTensor parameters for plain whole ones
    while it is gathered."""
    torch.manual_seed(0)
    model = P2RForCausalLM(tiny_config())
    pipeline = build_pipeline(model, schedule="1f1b", num_microbatches=2, seq_len=16, mesh=pipeline_mesh(1, 2),
                              shard=True)  # fmt: skip
    most = watch_gathered(list(pipeline.modules[0].layers.values()))
    ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    if direct:
        pipeline.step(ids)
    else:
        loss_fn = causal_lm_loss(101)
        stage = PipelineStage(pipeline.modules[0], 0, 1, pipeline.stages[0].device, group=pipeline.group)
        get_schedule_class("1F1B")(stage, 2, loss_fn=loss_fn).step(ids, target=ids, losses=[])
    return most()


def held_during_a_step(torch_stage: bool, delinked: bool) -> dict:
    """2 pipelines x 2 stages, sharded: this process's stage (4 blocks of an 8-block model, built real or `delinked`
    from a pseudo model of 1 block) through a 1F1B step of 2 micro-batches, run by the pipeline's stage or by torch's
    `PipelineStage` on the same module: the most of its blocks gathered at once, and after each micro-batch's backward
    whether every parameter of its blocks is sharded again (a DTensor: FSDP2 swaps in whole tensors while a unit is
    gathered) and holds a sharded gradient."""
    torch.manual_seed(0)
    fields = dict(share_layers=True, num_unique_layers=1, sharing_pattern="cycle") if delinked else {}
    pipeline = build_pipeline(P2RForCausalLM(tiny_config(**fields)), schedule="1f1b", num_microbatches=2, seq_len=16,
                              mesh=pipeline_mesh(2, 2), shard=True)  # fmt: skip
    if delinked:
        delink_stages(pipeline)
    module, stage = pipeline.modules[0], pipeline.stages[0]
    if torch_stage:
        stage = PipelineStage(module, stage.stage_index, stage.num_stages, stage.device, group=pipeline.group)
    blocks, sharded = list(module.layers.values()), []
    most = watch_gathered(blocks)
    backward_one_chunk = stage.backward_one_chunk

    def backward_then_look(*args, **kwargs):
        backward_one_chunk(*args, **kwargs)
        sharded.append(all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in module.layers.parameters()))

    stage.backward_one_chunk = backward_then_look
    ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(pipeline.data_rank))
    get_schedule_class("1F1B")(stage, 2, loss_fn=causal_lm_loss(101), scale_grads=False).step(
        *([ids] if stage.is_first else []), target=ids if stage.is_last else None, losses=[]
    )
    return {"most": most(), "sharded": sharded, "blocks": len(blocks)}


def stage_collectives() -> dict:
    """{pattern: [all-gathers, reduce-scatters] of one 1F1B step of 2 micro-batches} of this process's stage (4 depths
    of an 8-depth model), 2 stages x 2 sharded. Counting patches torch.distributed for the rest of the process: call
    it last."""
    from ..distributed.test_fsdp2 import CollectiveCounter

    counter, out = CollectiveCounter(), {}
    for pattern in ("real", "cycle"):
        torch.manual_seed(0)
        pipeline = build_pipeline(P2RForCausalLM(tiny_config(**PATTERNS[pattern])), schedule="1f1b",
                                  num_microbatches=2, seq_len=16, mesh=pipeline_mesh(2, 2), shard=True)  # fmt: skip
        ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(0))
        pipeline.step(ids)  # FSDP2's lazy initialisation
        before = counter.snapshot()
        pipeline.step(ids)
        out[pattern] = [after - earlier for after, earlier in zip(counter.snapshot(), before, strict=True)]
    return out


def _held(folder: str, rank: int, world: int) -> dict:
    out = {}
    for torch_stage in (False, True):
        for delinked in (False, True):
            name = ("torch" if torch_stage else "pipeline") + (" delinked" if delinked else "")
            out[name] = held_during_a_step(torch_stage, delinked)
    out["collectives"] = stage_collectives()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


PATTERNS = {
    "real": {},
    "cycle": dict(share_layers=True, num_unique_layers=1, sharing_pattern="cycle"),
    "sequence": dict(share_layers=True, num_unique_layers=2, sharing_pattern="sequence"),
}


def collectives(world: int) -> dict:
    """{pattern: ([all-gathers, reduce-scatters] of one step of one micro-batch, parameters left unsharded by an
    evaluation)} of an 8-depth model as one stage sharded over `world` processes. Counting patches torch.distributed
    for the rest of the process: call it last."""
    from ..distributed.test_fsdp2 import CollectiveCounter

    counter, out = CollectiveCounter(), {}
    for pattern, fields in PATTERNS.items():
        torch.manual_seed(0)
        pipeline = build_pipeline(P2RForCausalLM(tiny_config(**fields)), schedule="1f1b", num_microbatches=1,
                                  seq_len=16, mesh=pipeline_mesh(1, world), shard=True)  # fmt: skip
        ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
        pipeline.step(ids)  # FSDP2's lazy initialisation
        before = counter.snapshot()
        pipeline.step(ids)
        counts = [after - earlier for after, earlier in zip(counter.snapshot(), before, strict=True)]
        pipeline.evaluate([ids])
        gathered = sum(not isinstance(param, DTensor) for param in pipeline.parameters())
        out[pattern] = (counts, gathered)
    return out


def _two(folder: str, rank: int, world: int) -> dict:
    """2 processes: the shards a process holds, the gathered blocks, the sharded run and its checkpoints resumed
    sharded and replicated."""
    root = Path(folder)
    out = {"layout": shard_layout(world), "direct": unsharded_blocks(True), "torch": unsharded_blocks(False)}
    run(root / "sharded", **SHARDED)
    run(root / "2 micro-batches", **dict(SHARDED, num_microbatches=2))
    run(root / "replicated", **dict(SHARDED, data_parallel_shard="false"))
    run(root / "sharded from 1", 1, root / "sharded", **SHARDED)
    run(root / "sharded from 3", 3, root / "sharded", **SHARDED)
    run(root / "replicated from 3", 3, root / "sharded", **dict(SHARDED, data_parallel_shard="false"))
    if rank == 0:
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(root / "sharded/checkpoints/checkpoint-3").read_metadata().state_dict_metadata
        out["chunks"] = [list(chunk.sizes) for chunk in saved["model.model.layers.2.mlp.up_proj.weight"].chunks]
    out["collectives"] = collectives(world)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("one") / "run"
    run(output_dir, **SCHEDULE)
    return output_dir


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    return folder, spawn.run(functools.partial(_two, str(folder)), 2, folder)


def test_two_sharded_processes_train_as_one_process(one_process, two):
    """Pseudo (1 block), the delink, real (4 blocks): every loss, gradient norm and validation loss."""
    folder, _ = two
    assert_same_run(folder / "sharded", one_process, **TOLERANCE)


def test_two_replicated_processes_train_as_one_process(one_process, two):
    """`data_parallel_shard: false`: the whole model on each process, the gradients averaged as DDP does (one
    coalesced all-reduce per step)."""
    folder, _ = two
    assert_same_run(folder / "replicated", one_process, **TOLERANCE)


def test_micro_batches_are_gradient_accumulation(one_process, two):
    """`num_microbatches: 2` (one block each per process): the same run as one process on the whole batch."""
    folder, _ = two
    assert_same_run(folder / "2 micro-batches", one_process, **TOLERANCE)


def test_each_process_holds_only_its_shards(two):
    """Every parameter is a DTensor whose local shard is a part of dim 0 (the parts of the two processes make the
    whole); the checkpoint holds each weight as its two halves."""
    _, out = two
    for name, (kind, parts, shape) in out["layout"].items():
        assert kind == "DTensor", name
        assert sum(parts) == shape[0] and max(parts) < shape[0], name
    assert out["chunks"] == [[32, 32], [32, 32]]


@pytest.mark.parametrize("stage", ["pseudo", "real"])
def test_the_model_folders_equal_the_one_process_ones(one_process, two, stage):
    """`pseudo/` (written at the delink) and `real/` (at the end), each written from the processes' shards."""
    folder, _ = two
    got, want = folder_tensors(folder / "sharded" / stage), folder_tensors(one_process / stage)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **WEIGHTS_TOLERANCE, msg=name)


def test_the_sharded_checkpoint_resumes_bitwise_sharded_and_replicated(two):
    """Before the delink (1) and after it (3), sharded; after it, as replicated processes (DDP-like averaging of the
    whole gradients, the same sums as the reduce-scatter): every value bitwise."""
    folder, _ = two
    assert_same_run(folder / "sharded from 1", folder / "sharded")
    assert_same_run(folder / "sharded from 3", folder / "sharded")
    assert_same_run(folder / "replicated from 3", folder / "sharded")


@pytest.mark.parametrize("checkpoint", [1, 3])
def test_the_sharded_checkpoint_resumes_on_one_process(two, tmp_path, checkpoint):
    """The Accelerate engine, one process, the whole global batch: its losses continue the sharded run's."""
    folder, _ = two
    one = dict(SCHEDULE, per_device_batch_size=4, data_parallel_size=1, data_parallel_shard="false")  # (given: a resume
    run(tmp_path / "one", checkpoint, folder / "sharded", **one)  # takes the saved layout otherwise)
    assert_same_run(tmp_path / "one", folder / "sharded", **TOLERANCE)


def test_fsdp2_gathers_a_block_or_two_at_once_not_the_whole_stage(two):
    """Measured: run directly, at most 2 of the 8 blocks are gathered at once (the one running and the one FSDP2
    prefetches); torch's one-stage 1F1B defers every reshard to the end of the step: all 8."""
    _, out = two
    assert out["direct"] <= 2
    assert out["torch"] == 8


def test_a_shared_block_is_gathered_once_per_step(two):
    """FSDP2 units: the root (embeddings, norm, head) and each block. The root all-gathers once per step; a real block
    twice (forward, backward), a shared block once however many depths run it (`gather_shared_once`, as the Accelerate
    engine's FSDP2); each unit reduce-scatters once. An evaluation leaves every parameter sharded (a shared block is
    not resharded by its forward)."""
    _, out = two
    assert out["collectives"] == {"real": [[1 + 2 * 8, 1 + 8], 0], "cycle": [[1 + 1, 1 + 1], 0],
                                  "sequence": [[1 + 2, 1 + 2], 0]}  # fmt: skip


def test_sharded_pipeline_stages_reshard_and_reduce_each_micro_batch(tmp_path):
    """2 stages x 2 sharded (4 processes), real and after the delink: after each micro-batch's backward every
    parameter of a stage's blocks is sharded again and holds its sharded gradient (FSDP2's gradient accumulation, a
    reduce-scatter per micro-batch), and at most 2 of a stage's 4 blocks are gathered at once. torch's `PipelineStage`
    on the same module defers FSDP2's reshard and reduce-scatter to the step's end: all 4 gathered, the gradients
    whole (none on the shards yet). Collectives of a step per stage, the root's (embeddings or head) aside: a real
    stage's 4 blocks are all-gathered in each micro-batch's forward and backward (2 x 2 x 4) and reduce-scatter once
    per micro-batch (2 x 4); a pseudo stage's one block run at its 4 depths is gathered once per micro-batch and kept
    over its uses (`gather_shared_once` on the stage's depths: 2, not 16), and reduce-scatters once per micro-batch
    (2). Measured on torch 2.13: real 18 all-gathers and 10 reduce-scatters, pseudo 4 and 4 (18 and 4 without the
    gather once); torch 2.15 reduces a first stage's root once per step, one fewer of each."""
    ranks = spawn.run(functools.partial(_held, str(tmp_path)), 4, tmp_path)["ranks"]
    for held in ranks:
        for run in ("pipeline", "pipeline delinked"):
            assert held[run]["blocks"] == 4, run
            assert held[run]["sharded"] == [True, True], run
            assert held[run]["most"] <= 2, run
        for run in ("torch", "torch delinked"):
            assert held[run]["sharded"] == [False, False], run
            assert held[run]["most"] == 4, run
        (real_gathers, real_reductions), (cycle_gathers, cycle_reductions) = held["collectives"].values()
        assert [real_gathers - cycle_gathers, real_reductions - cycle_reductions] == [2 * 2 * 4 - 2, 2 * 4 - 2]


def _four(folder: str, rank: int, world: int) -> dict:
    root = Path(folder)
    run(root / "four", **FOUR)
    run(root / "four from 1", 1, root / "two", **FOUR)
    run(root / "four from 3", 3, root / "two", **FOUR)
    return {}


@pytest.mark.slow
def test_four_sharded_processes_train_as_one_process_and_resume_two(one_process, two, tmp_path):
    """4 processes (one block each per step): a fresh run equals one process; the 2-process checkpoints, before and
    after the delink, resumed on 4 continue the 2-process run."""
    folder, _ = two
    shutil.copytree(folder / "sharded", tmp_path / "two")
    spawn.run(functools.partial(_four, str(tmp_path)), 4, tmp_path)
    assert_same_run(tmp_path / "four", one_process, **TOLERANCE)
    assert_same_run(tmp_path / "four from 1", folder / "sharded", **TOLERANCE)
    assert_same_run(tmp_path / "four from 3", folder / "sharded", **TOLERANCE)


# --- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(data_parallel_shard="true"), r"^data_parallel_shard: shards over data_parallel_size > 1 processes"),
        (dict(pipeline_schedule="2bw"), r"^pipeline_schedule: PipeDream-2BW delays the update .* use 1f1b"),
        (dict(pipeline_schedule="interleaved_1f1b"), r"^pipeline_schedule: interleaved 1F1B runs several stages"),
        (dict(mixed_precision="bf16"), r"^mixed_precision: not supported with data_parallel_size > 1"),
        (dict(offload="0.5"), r"^offload: not supported with data_parallel_size > 1"),
        (dict(gradient_accumulation_steps=2), r"^gradient_accumulation_steps: not supported with data_parallel_size"),
        (dict(num_microbatches=3), r"^num_microbatches: 3 must divide per_device_batch_size"),
    ],
)
def test_what_one_sharded_stage_does_not_run_is_refused_in_one_line(tmp_path, fields, message):
    base = dict(data_parallel_size=2, data_parallel_shard="true")
    if "data_parallel_shard" in fields:
        base = {}
    with pytest.raises(ValueError, match=message) as error:
        parse_config(tiny_argv(tmp_path, **{**base, **fields}))
    assert "\n" not in str(error.value)


def test_data_parallel_size_picks_the_pipeline_engine_which_needs_its_processes(tmp_path):
    """One process asked for 2 data-parallel processes: the pipeline engine (not Accelerate's) refuses, naming the
    field."""
    config = parse_config(tiny_argv(tmp_path, data_parallel_size=2, data_parallel_shard="true"))
    with pytest.raises(ValueError, match=r"^data_parallel_size: 1 stages x data_parallel_size 2 need as many"):
        engine_for(config)


def test_a_mixture_of_experts_model_is_refused_in_one_line(tmp_path):
    """Refused by the configuration's rules (hf_p2r.config.rules), which the planner applies too."""
    argv = tiny_argv(tmp_path, data_parallel_size=2, data_parallel_shard="true", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match=r"^num_experts: mixture-of-experts models are not supported by the pipeline"):
        parse_config(argv)


def test_one_stage_holds_one_micro_batch_whatever_the_schedule():
    """The registry's fact the planner sizes activations from: one stage runs its micro-batches one after the other
    (`AccumulateSchedule`), so GPipe holds one there, every one of them only in a pipeline."""
    from hf_p2r.distributed.pipeline.schedules import get_schedule

    assert [get_schedule(name).in_flight(1, 0, 4) for name in ("gpipe", "1f1b")] == [1, 1]
    assert [get_schedule(name).in_flight(2, 0, 4) for name in ("gpipe", "1f1b")] == [4, 2]
