"""Granular offload inside the trainer: the same training with and without it, and `offload: auto` switching on
at the delink (the pseudo model fits, the real one needs it). Without CUDA the compute device is the CPU: the same
code path runs, with CPU-to-CPU copies."""

import shutil
from types import SimpleNamespace

import pytest
import torch

from hf_p2r.training import parse_config, train
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.offload import apply_offload, estimate_device_bytes, measure_offload_activations, spread_layers
from hf_p2r.training.train import build_model

from .helpers import TWO_DELINKS, tiny_argv, trained_run, trajectory

SCHEDULE = TWO_DELINKS


plain_run = trained_run("plain_run", **SCHEDULE)


def _final_weights(output_dir):
    from safetensors.torch import load_file

    return load_file(output_dir / "real" / "model.safetensors")


def test_offloaded_training_equals_plain_training(plain_run, tmp_path):
    output_dir = tmp_path / "run"
    assert train(parse_config(tiny_argv(output_dir, **SCHEDULE, offload="0.5"))) == 0
    assert trajectory(output_dir) == trajectory(plain_run)  # every loss, learning rate and gradient norm, bitwise
    offloaded, plain = _final_weights(output_dir), _final_weights(plain_run)
    assert offloaded.keys() == plain.keys()
    assert all(torch.equal(offloaded[k], plain[k]) for k in plain)
    delinks = [r for r in read_metrics(output_dir / "metrics.jsonl") if r.get("event") == "delink"]
    assert [r["offloaded_blocks"] for r in delinks] == [[1], [1, 3]]  # half of 2 blocks, then of 4


@pytest.fixture(scope="module")
def design_runs(tmp_path_factory):
    """{offload_optimizer: output folder} of offload 0.5 with a checkpoint every step, each run on first use: host
    (each offloaded block stepped on the CPU while the next forward runs, the clip's scaling deferred to it) and
    device_chunked in chunks small enough that each step takes several."""
    done = {}

    def run(design: str):
        if design not in done:
            output_dir = tmp_path_factory.mktemp(design) / "run"
            assert train(parse_config(tiny_argv(output_dir, **SCHEDULE, **DESIGNS[design], save_steps=1))) == 0
            done[design] = output_dir
        return done[design]

    return run


DESIGNS = {
    "host": dict(offload="0.5", offload_optimizer="host"),
    "device_chunked": dict(offload="0.5", offload_optimizer="device_chunked", offload_chunk_mb=0.01),
}


@pytest.mark.parametrize("design", list(DESIGNS))
def test_each_offload_design_trains_like_plain_training(plain_run, design_runs, design):
    """Through both delinks (the optimizer rebuilt and its state carried each time; device_chunked in 0.01 MiB
    chunks, 10 KiB: a block of the tiny model is several): every loss, learning rate and gradient norm, and the final
    weights, bit for bit as without offload."""
    output_dir = design_runs(design)
    assert trajectory(output_dir) == trajectory(plain_run)
    got, plain = _final_weights(output_dir), _final_weights(plain_run)
    assert all(torch.equal(got[k], plain[k]) for k in plain)


@pytest.mark.parametrize("resume_step", [3, 5])  # after the partial delink (2 blocks), after the real delink
@pytest.mark.parametrize("design", list(DESIGNS))
def test_each_offload_design_resumes_exactly(design_runs, tmp_path, design, resume_step):
    full = design_runs(design)
    output_dir = tmp_path / "run"
    shutil.copytree(full, output_dir)
    checkpoint = output_dir / "checkpoints" / f"checkpoint-{resume_step}"
    argv = tiny_argv(output_dir, **SCHEDULE, **DESIGNS[design], save_steps=1, resume_from_checkpoint=checkpoint)
    assert train(parse_config(argv)) == 0
    assert trajectory(output_dir) == trajectory(full)


# Issue 40's designs in the trainer, over 2 micro-batches per step (Accelerate's `sync_gradients` says which is last).
# One checkpoint in the middle of the real stage: a checkpoint drains the delayed update (the step after it is
# exact), so checkpoints at every step would make the delayed run plain training's.
MICRO = dict(**SCHEDULE, gradient_accumulation_steps=2, save_steps=5)


@pytest.fixture(scope="module")
def micro_runs(tmp_path_factory):
    """{name: output folder}, each run on first use: plain, offload 0.5 with the gradients summed on the device, and
    offload 0.5 with the delayed update (summed on the device too); 2 micro-batches per step, a checkpoint each."""
    done = {}
    fields = {
        "plain": {},
        "device_sums": dict(offload="0.5", offload_grad_accumulation="device"),
        "delayed": dict(offload="0.5", offload_grad_accumulation="device", offload_update="delayed"),
    }

    def run(name: str):
        if name not in done:
            output_dir = tmp_path_factory.mktemp(name) / "run"
            assert train(parse_config(tiny_argv(output_dir, **MICRO, **fields[name]))) == 0
            done[name] = output_dir
        return done[name], fields[name]

    return run


def test_gradients_summed_on_the_device_train_like_plain_training(micro_runs):
    """Sent once per step, by the micro-batch Accelerate marks as the last: every loss, learning rate and gradient
    norm, and the final weights, bit for bit as without offload."""
    (summed, _), (plain, _) = micro_runs("device_sums"), micro_runs("plain")
    assert trajectory(summed) == trajectory(plain)
    got, expected = _final_weights(summed), _final_weights(plain)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", ["device_sums", "delayed"])
def test_the_designs_resume_exactly(micro_runs, tmp_path, name):
    """A resume after the real delink continues as the uninterrupted run (the delayed update drains at every
    checkpoint, so both runs send the same weights after it); the delayed run is not plain training's (control)."""
    full, fields = micro_runs(name)
    output_dir = tmp_path / "run"
    shutil.copytree(full, output_dir)
    checkpoint = output_dir / "checkpoints" / "checkpoint-5"
    assert train(parse_config(tiny_argv(output_dir, **MICRO, **fields, resume_from_checkpoint=checkpoint))) == 0
    assert trajectory(output_dir) == trajectory(full)
    if name == "delayed":
        assert trajectory(full) != trajectory(micro_runs("plain")[0])


def test_the_update_during_backward_refuses_a_clip(tmp_path):
    from hf_p2r.training.config import ConfigError

    """Refused while the configuration is parsed (hf_p2r.config.rules), before the run starts."""
    with pytest.raises(ConfigError, match="^offload_update: during_backward steps each offloaded block before"):
        parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, offload="0.5", offload_update="during_backward"))
    assert not (tmp_path / "run").exists()


def test_bad_offload_optimizer_names_the_field(tmp_path):
    with pytest.raises(
        ValueError, match=r"offload_optimizer.*invalid choice: 'gpu' \(choose from 'host', 'device_chunked'\)"
    ):
        parse_config(tiny_argv(tmp_path, offload="0.5", offload_optimizer="gpu"))
    with pytest.raises(ValueError, match="^offload_chunk_mb: must satisfy 0.0 < offload_chunk_mb, got 0"):
        parse_config(tiny_argv(tmp_path, offload="0.5", offload_chunk_mb="0"))


def test_offload_auto_switches_on_at_delink(plain_run, tmp_path):
    """With a budget the pseudo model fits in, auto offloads nothing until the real model needs it."""
    config = parse_config(tiny_argv(tmp_path / "probe", **SCHEDULE))
    tokenizer, accelerator = load_tokenizer(None), SimpleNamespace(mixed_precision="no", device=torch.device("cpu"))
    args = config.offload
    args.offload = "auto"
    pseudo, real = build_model(config, tokenizer, 1), build_model(config, tokenizer, 4)
    batch_size = config.compute.per_device_batch_size
    activations = measure_offload_activations(pseudo, args, config.data.block_size, accelerator, batch_size)
    assert activations == measure_offload_activations(real, args, config.data.block_size, accelerator, batch_size) > 0
    # A budget that fits the real model with 2 of its 4 blocks offloaded, but not with 1.
    budget = estimate_device_bytes(real, spread_layers(2, 4), activation_bytes=activations)
    assert estimate_device_bytes(real, spread_layers(1, 4), activation_bytes=activations) > budget
    assert estimate_device_bytes(pseudo, [], activation_bytes=activations) <= budget
    args.offload_budget_gb = budget / 2**30
    assert apply_offload(pseudo, args, accelerator, activations).layers == []

    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, **SCHEDULE, offload="auto", offload_budget_gb=budget / 2**30)
    assert train(parse_config(argv)) == 0
    delinks = [r for r in read_metrics(output_dir / "metrics.jsonl") if r.get("event") == "delink"]
    assert [r["offloaded_blocks"] for r in delinks] == [[], spread_layers(2, 4)]
    assert trajectory(output_dir) == trajectory(plain_run)


@pytest.mark.parametrize(
    ("mixed_precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None)]
)
def test_offloaded_blocks_run_in_the_autocast_dtype(tmp_path, mixed_precision, dtype):
    """Under bf16 and fp16 mixed precision the offloaded blocks' device copies are in the autocast dtype: otherwise
    autocast would keep a cast of every offloaded weight from forward to backward."""
    config = parse_config(tiny_argv(tmp_path, offload="1.0"))
    accelerator = SimpleNamespace(mixed_precision=mixed_precision, device=torch.device("cpu"))
    offload = apply_offload(build_model(config, load_tokenizer(None), 4), config.offload, accelerator)
    assert offload.compute_dtype == dtype
    works = {work.dtype for block in offload._blocks.values() for work in block.works}
    assert works == {dtype or torch.float32}


@pytest.mark.parametrize(
    ("value", "spec"), [("auto", "auto"), ("0.5", 0.5), ("[1, 3]", [1, 3]), ("none", None), (None, None)]
)
def test_offload_values_from_the_command_line(tmp_path, value, spec):
    extra = {} if value is None else {"offload": value}
    # The real model (4 blocks) from scratch: indices 1 and 3 exist; a CPU run's auto needs a budget.
    extra.update(pseudo_steps=0, offload_budget_gb=1)
    assert parse_config(tiny_argv(tmp_path, **extra)).train.offload_spec == spec


def test_offload_values_from_yaml(tmp_path):
    cases = (("offload: 0.25", 0.25), ("offload: [0, 2]\npseudo_steps: 0", [0, 2]), ("offload: auto", "auto"))
    for text, spec in cases:
        path = tmp_path / "config.yaml"
        path.write_text(text + "\n")
        assert parse_config(["--config", str(path)]).train.offload_spec == spec


@pytest.mark.parametrize("value", ["1.5", "half", "[1, two]", "-0.1"])
def test_bad_offload_values_name_the_field(tmp_path, value):
    with pytest.raises(ValueError, match="^offload: "):
        parse_config(tiny_argv(tmp_path, offload=value))
