"""The trainer under {fp32, bf16 through Accelerate} x {no offload, a ratio, auto} x {pseudo stage, through the delink}.

bf16 with offload used to crash right after the delink (F.linear: "expected m1 and m2 to have the same dtype"):
re-preparing the delinked model gave it back without Accelerate's autocast forward, so fp32 activations met the
offloaded blocks' bf16 working copies; without offload the real stage silently ran in fp32. Each of the six runs
below goes pseudo (1 block) -> 2 blocks -> real (4 blocks), and records the dtype every Linear computed in.
"""

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from hf_p2r.errors import exit_code
from hf_p2r.training import ConfigError, parse_config, train
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.metrics import read_metrics
from hf_p2r.training.offload import apply_offload, estimate_device_bytes, measure_offload_activations, spread_layers
from hf_p2r.training.train import build_model

from .helpers import tiny_argv

SCHEDULE = dict(pseudo_steps=3, real_steps=2, partial_delink_steps=[2], partial_delink_blocks=[2], eval_steps=0)
DTYPES = {"no": torch.float32, "bf16": torch.bfloat16}
# Blocks offloaded at the start (1 block) and after each delink (2, then 4 blocks).
EXPECTED = {
    "none": (None, [None, None]),
    "0.5": ([0], [[1], [1, 3]]),
    # A budget that fits the pseudo model and the 2-block model with nothing offloaded, the real one only with 2 of
    # its 4 blocks offloaded: offload switches on at the last delink (M6-10T's combination with mixed precision).
    "auto": ([], [[], [1, 3]]),
}


def _auto_budget_gb(tmp_path, mixed_precision: str) -> float:
    """The device budget, in GiB, with which `offload: auto` offloads 2 of the real model's 4 blocks and none
    before, under `mixed_precision` (its compute dtype and its autocast activations). On the CPU auto has no device
    memory to plan for, so the run must be given one."""
    config = parse_config(tiny_argv(tmp_path / "probe", **SCHEDULE, offload="auto", offload_budget_gb=1))
    accelerator = SimpleNamespace(mixed_precision=mixed_precision, device=torch.device("cpu"))
    tokenizer, dtype = load_tokenizer(None), {"bf16": torch.bfloat16}.get(mixed_precision)
    models = {blocks: build_model(config, tokenizer, blocks) for blocks in (1, 2, 4)}
    batch, block_size = config.compute.per_device_batch_size, config.data.block_size
    activations = measure_offload_activations(models[1], config.offload, block_size, accelerator, batch)
    need = {
        (blocks, count): estimate_device_bytes(
            model, spread_layers(count, blocks), activation_bytes=activations, compute_dtype=dtype
        )
        for blocks, model in models.items()
        for count in range(blocks + 1)
    }
    budget = need[4, 2]
    assert need[4, 1] > budget >= max(need[1, 0], need[2, 0])
    return budget / 2**30


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(mixed_precision, offload): (exit code, output folder, what it printed, the dtypes of every Linear's output)},
    each run on first use."""
    done = {}

    def run(mixed_precision: str, offload: str):
        if (mixed_precision, offload) not in done:
            tmp_path = tmp_path_factory.mktemp(f"{mixed_precision}-{offload}")
            extra = {"offload": offload}
            if offload == "auto":
                extra["offload_budget_gb"] = _auto_budget_gb(tmp_path, mixed_precision)
            argv = tiny_argv(tmp_path / "run", **SCHEDULE, mixed_precision=mixed_precision, **extra)
            dtypes = set()

            def record(module, args, output):
                if isinstance(module, torch.nn.Linear):
                    dtypes.add(output.dtype)

            handle = torch.nn.modules.module.register_module_forward_hook(record)
            try:
                with contextlib.redirect_stdout(io.StringIO()) as printed:
                    code = train(parse_config(argv))
            finally:
                handle.remove()
                # Accelerate keeps one process-wide state, whose mixed precision is fixed once set; its own test
                # case resets it the same way between tests.
                AcceleratorState._reset_state(reset_partial_state=True)
                GradientState._reset_state()
            done[mixed_precision, offload] = code, tmp_path / "run", printed.getvalue(), dtypes
        return done[mixed_precision, offload]

    return run


@pytest.mark.parametrize("stage", ["pseudo", "delink"])
@pytest.mark.parametrize("offload", list(EXPECTED))
@pytest.mark.parametrize("mixed_precision", list(DTYPES))
def test_training_runs_in_every_precision_and_offload(runs, mixed_precision, offload, stage):
    code, output_dir, printed, dtypes = runs(mixed_precision, offload)
    assert code == 0
    records = read_metrics(output_dir / "metrics.jsonl")
    wanted = "pseudo" if stage == "pseudo" else "real"
    losses = {r["step"]: r["loss"] for r in records if "loss" in r and r["stage"] == wanted}
    assert losses and all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert dtypes == {DTYPES[mixed_precision]}  # autocast on from the first step to the last (fp32: never on)
    start, after_delinks = EXPECTED[offload]
    if stage == "pseudo":
        assert sorted(losses) == [1, 2, 3]
        if start is not None:
            assert f"offload: blocks {start} of 1 in CPU memory" in printed
    else:
        assert sorted(losses) == [4, 5]
        delinks = [r for r in records if r.get("event") == "delink"]
        assert [(r["step"], r["num_blocks"]) for r in delinks] == [(2, 2), (3, 4)]
        assert [r.get("offloaded_blocks") for r in delinks] == after_delinks
        assert (output_dir / "real" / "model.safetensors").is_file()


def test_auto_on_the_cpu_asks_for_a_budget(tmp_path):
    """A CPU run has no device memory for auto to plan for: a configuration error (exit code 2) naming the setting to
    give, while parsing where the run says `cpu: true`, else once the trainer knows its device."""
    with pytest.raises(ConfigError, match="^offload: auto .* computes on cpu: set offload_budget_gb"):
        parse_config(tiny_argv(tmp_path, offload="auto"))  # tiny_argv says cpu: true
    config = parse_config(tiny_argv(tmp_path, offload="auto", cpu="false"))
    accelerator = SimpleNamespace(mixed_precision="no", device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="^offload: auto .* set offload_budget_gb") as caught:
        apply_offload(build_model(config, load_tokenizer(None), 1), config.offload, accelerator)
    assert exit_code(caught.value) == 2


def test_offload_none_is_no_offload(tmp_path):
    assert parse_config(tiny_argv(tmp_path, offload="none")).train.offload is None


@pytest.mark.parametrize("mixed_precision", list(DTYPES))
def test_the_clip_norm_of_an_offloaded_run_is_the_plain_runs(runs, mixed_precision):
    """The trainer's clip under offload takes the offloaded blocks' gradient norms as they left the device; the norms
    it logs are those torch's clip_grad_norm_ logs without offload: bitwise in fp32, at every step through the delink.
    In bf16: at the first step (the same weights and batch) within 1e-6 (equal when written: the offloaded block runs
    on bf16 copies of its weights, the values autocast casts them to), then within 2e-3 as the runs drift apart in bf16
    rounding (at most 3e-4 seen)."""
    norms = {}
    for offload in ("none", "0.5"):
        code, output_dir, _, _ = runs(mixed_precision, offload)
        assert code == 0
        norms[offload] = [r["grad_norm"] for r in read_metrics(output_dir / "metrics.jsonl") if "grad_norm" in r]
    assert len(norms["none"]) == len(norms["0.5"]) == 5
    if mixed_precision == "no":
        assert norms["0.5"] == norms["none"]
    else:
        assert norms["0.5"][0] == pytest.approx(norms["none"][0], rel=1e-6)
        assert norms["0.5"] == pytest.approx(norms["none"], rel=2e-3)
