"""DCP checkpoints of DeepSpeed ZeRO-3 runs (`checkpoint_format: dcp`) on two gloo processes: each process writes its
share of the whole tensors, gathered one parameter at a time (`zero3_training_state`), under the model's names, so a
ZeRO-3 checkpoint resumes on ZeRO-3 (bitwise), on one plain process, and a plain process's checkpoint on ZeRO-3
(within float rounding: parts of the batch on several processes against the whole batch on one); on 2 and 3
processes.

Skipped without deepspeed (`pip install hf-p2r[deepspeed]`).
"""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_p2r.compat import dcp_reader
from hf_p2r.distributed.deepspeed import materialize_zero3, zero3_training_state
from hf_p2r.training import parse_config, train
from hf_p2r.training.dcp import is_dcp_checkpoint, load_model_state, load_zero3_state, model_state
from hf_p2r.training.dcp import save as save_dcp

from ..training.helpers import ACCELERATE, REPO, subprocess_env, tiny_argv, trajectory
from . import spawn
from .test_deepspeed_zero_init import ENGINE, SEED, built

pytestmark = pytest.mark.usefixtures("deepspeed_offload_ops")  # built once, before the first launch (conftest)

deepspeed = pytest.importorskip("deepspeed")

LR, WEIGHT_DECAY = 0.01, 0.1
STEPS, SAVED_AT = 4, 2  # steps in all; the checkpoint after this many
ATOL = 1e-5  # losses: two processes' half batches against one process's whole batch, fp32
CASES = ("pseudo", "tied")  # a shared block; tied embeddings (the head saved once, under the embeddings' name)


def batches() -> list[torch.Tensor]:
    """Two rows per process."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 101, (2 * dist.get_world_size(), 12), generator=generator) for _ in range(STEPS)]


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def zero3_engine(case: str, seed: int):
    config = {**ENGINE, "bf16": {"enabled": False}}
    model = materialize_zero3(built(case, meta=True), seed, config).train()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer_of(model), config=config)
    return engine


def zero3_steps(engine, steps: range, rank: int) -> list[float]:
    """The whole batch's loss at each step (the mean of the processes' parts of it)."""
    losses = []
    for step in steps:
        part = batches()[step][rank * 2 : rank * 2 + 2]
        loss = engine(input_ids=part, labels=part).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def plain_steps(model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        whole = batches()[step]
        loss = model(input_ids=whole, labels=whole).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def entries(folder: Path) -> dict:
    """{DCP entry: (shape, dtype)} of a checkpoint: what any layout's load asks for."""
    saved = dcp_reader(folder).read_metadata().state_dict_metadata
    return {key: (list(value.size), str(value.properties.dtype)) for key, value in sorted(saved.items())}


def resumes(rank: int, world_size: int) -> dict:
    """Per case: a ZeRO-3 run saved at step 2 and run on to 4; its checkpoint resumed by a new ZeRO-3 engine (built
    from another seed) and by one plain process (each process the same, replicated); a plain run's checkpoint at step
    2 resumed by ZeRO-3. The losses of steps 3 and 4 each time, and what each process saved."""
    root = spawn.shared_folder()
    out = {}
    for case in CASES:
        zero3_folder, plain_folder = Path(root, f"{case}-zero3"), Path(root, f"{case}-plain")
        engine = zero3_engine(case, SEED)
        first = zero3_steps(engine, range(SAVED_AT), rank)
        state = zero3_training_state(engine)
        save_dcp(zero3_folder, state)
        uninterrupted = first + zero3_steps(engine, range(SAVED_AT, STEPS), rank)
        shares = [None] * world_size
        dist.all_gather_object(shares, sorted(state["model"]))
        keys = sorted({key for values in state["optimizer"].values() for key in values})

        resumed = zero3_engine(case, SEED + 1)  # other weights, until the checkpoint loads
        load_zero3_state(zero3_folder, resumed)
        zero3_resumed = zero3_steps(resumed, range(SAVED_AT, STEPS), rank)

        model = built(case, meta=False).train()  # one plain process (the same on both: replicated)
        optimizer = optimizer_of(model)
        load_model_state(zero3_folder, model, optimizer)
        plain_resumed = plain_steps(model, optimizer, range(SAVED_AT, STEPS))

        model = built(case, meta=False).train()  # a plain run's checkpoint, resumed on ZeRO-3
        optimizer = optimizer_of(model)
        plain = plain_steps(model, optimizer, range(SAVED_AT))
        save_dcp(plain_folder, model_state(model, optimizer))
        plain += plain_steps(model, optimizer, range(SAVED_AT, STEPS))
        from_plain = zero3_engine(case, SEED + 1)
        load_zero3_state(plain_folder, from_plain)
        out[case] = {
            "uninterrupted": uninterrupted,
            "zero3_resumed": zero3_resumed,
            "plain_resumed": plain_resumed,
            "plain": plain,
            "zero3_from_plain": zero3_steps(from_plain, range(SAVED_AT, STEPS), rank),
            "shares": shares,
            "names": sorted(dict(engine.module.named_parameters())),
            "keys": keys,
            "same_entries": entries(zero3_folder) == entries(plain_folder),  # names, shapes, dtypes
        }
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def runs(request, tmp_path_factory) -> dict:
    """Two processes, and three (where ZeRO-3 pads every partition: no tensor of the model divides by 3)."""
    return spawn.run(resumes, request.param, tmp_path_factory.mktemp("zero3_dcp"))


@pytest.mark.parametrize("case", CASES)
def test_zero3_dcp_checkpoint_is_each_process_a_share_of_the_whole_tensors(runs, case):
    run = runs[case]
    shares = run["shares"]
    assert all(shares) and sorted(sum(shares, [])) == run["names"]  # every parameter by one process, once (a tied
    # head under the embeddings' name)
    assert ("lm_head.weight" in run["names"]) == (case != "tied")
    assert run["keys"] == ["exp_avg", "exp_avg_sq", "step"]  # AdamW's state, as one process's torch AdamW holds it
    assert run["same_entries"]  # the entries of a plain process's checkpoint: the same names, shapes and dtypes


@pytest.mark.parametrize("case", CASES)
def test_zero3_dcp_checkpoint_resumes_on_zero3_bitwise(runs, case):
    run = runs[case]
    assert run["zero3_resumed"] == run["uninterrupted"][SAVED_AT:]


@pytest.mark.parametrize("case", CASES)
def test_zero3_and_one_process_resume_each_others_dcp_checkpoints(runs, case):
    run = runs[case]
    moved = abs(run["uninterrupted"][-1] - run["uninterrupted"][0])
    assert moved > 100 * ATOL  # control: the steps move the loss far beyond the tolerance
    assert max(abs(a - b) for a, b in zip(run["plain_resumed"], run["uninterrupted"][SAVED_AT:], strict=True)) < ATOL
    assert max(abs(a - b) for a, b in zip(run["zero3_from_plain"], run["plain"][SAVED_AT:], strict=True)) < ATOL


def test_the_trainer_under_accelerates_zero3_plugin_and_one_plain_process_resume_each_others_dcp_checkpoints(tmp_path):
    """The trainer with `checkpoint_format: dcp` under `accelerate launch --config_file
    configs/accelerate/deepspeed_zero3_offload.yaml` (one process: Accelerate keeps DeepSpeed on a CPU run with `cpu:
    false`, in one process) saves a real-stage checkpoint; one plain process (this one) resumes it and saves its own,
    which the ZeRO-3 trainer resumes in turn: every step's loss as the uninterrupted ZeRO-3 run's."""
    fields = {"seed": SEED, "mixed_precision": "no", "optimizer_carry": "reset", "pseudo_steps": 3, "real_steps": 4}
    fields.update(eval_steps=0, save_steps=2, save_total_limit=5, checkpoint_format="dcp")
    config = str(REPO / "configs/accelerate/deepspeed_zero3_offload.yaml")
    launch = [ACCELERATE, "launch", "--config_file", config, "--num_processes", "1", "--main_process_port", "0"]
    zero3 = [*launch, "-m", "hf_p2r.train"]
    runs = {  # name: (command (None: the plain run, in this process), its extra fields, the checkpoint it resumes)
        "zero3": (zero3, {"cpu": "false"}, None),
        "plain": (None, {}, tmp_path / "zero3" / "checkpoints" / "checkpoint-4"),
        "zero3-again": (zero3, {"cpu": "false"}, tmp_path / "plain" / "checkpoints" / "checkpoint-6"),
    }
    for name, (command, extra, checkpoint) in runs.items():
        resume = [] if checkpoint is None else ["--resume_from_checkpoint", str(checkpoint)]
        argv = [*tiny_argv(tmp_path / name, **fields, **extra), *resume]
        if command is None:
            assert train(parse_config(argv)) == 0, name
            continue
        done = subprocess.run(
            [*command, *argv], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    losses = {name: {r["step"]: r["loss"] for r in trajectory(tmp_path / name) if "loss" in r} for name in runs}
    assert sorted(losses["zero3"]) == list(range(1, 8))
    assert all(is_dcp_checkpoint(checkpoint) for _, _, checkpoint in runs.values() if checkpoint is not None)
    assert sorted(losses["plain"]) == [5, 6, 7] and sorted(losses["zero3-again"]) == [7]
    assert abs(losses["zero3"][7] - losses["zero3"][5]) > 100 * ATOL  # control: the steps move the loss
    for name in ("plain", "zero3-again"):
        assert all(abs(loss - losses["zero3"][step]) < ATOL for step, loss in losses[name].items()), losses
