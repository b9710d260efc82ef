"""DeepSpeed ZeRO-3 from the meta device (two gloo processes): `materialize_zero3` partitions the trainer's meta model
one module at a time (what `deepspeed.zero.Init` does) to the weights one process initialises for the same seed,
bitwise, for pseudo, real and MoE models; each process keeps a fraction; the engine's path under Accelerate's
DeepSpeed plugin (configs/accelerate/deepspeed_zero3_offload.yaml) builds and partitions the same; the delink of a
ZeRO-3 engine (`delink_deepspeed`) goes straight into the new model's partitions and trains like one process; and the
Accelerate engine itself builds, steps and delinks under that plugin (one process: Accelerate sets up no several
processes on CPU).

Skipped without deepspeed (`pip install hf-p2r[deepspeed]`).
"""

import filecmp
import functools
import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator

from hf_p2r.checkpoint import save_model
from hf_p2r.checkpoint.sharded_write import save_model_from_shards
from hf_p2r.compat import zero3_full
from hf_p2r.distributed.deepspeed import delink_deepspeed, materialize_zero3, partition_zero3, zero3_owned_state
from hf_p2r.distributed.materialize import materialize
from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import save_model as save_model_gathered
from hf_p2r.training.data import load_tokenizer
from hf_p2r.training.optim import build_optimizer
from hf_p2r.training.train import build_model

from ..training.helpers import ACCELERATE, REPO, subprocess_env, tiny_argv, trajectory
from . import spawn
from .test_accelerate_configs import launch_env, use_launch_env

pytestmark = pytest.mark.usefixtures("deepspeed_offload_ops")  # built once, before the first launch (conftest)

deepspeed = pytest.importorskip("deepspeed")

CASES = {
    "pseudo": {"num_unique_layers": 1},
    "real": {"pseudo_steps": 0},  # a real model from scratch
    "moe": {"num_unique_layers": 2, "num_experts": 4, "num_experts_per_tok": 2},
}
SEED = 7
ENGINE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}
LR, ATOL = 0.5, 1e-5  # as test_deepspeed: fp32, SGD (the optimizer restarts at a delink), half batches against one
DELINKS = {1: 2, 2: None}  # step -> the blocks after delink_deepspeed there (None: the real model)
SAVED = {"tied": {"num_unique_layers": 2, "tie_word_embeddings": True}}  # with "pseudo" and "real"
SMALL_SHARDS = 20_000  # bytes: the tiny models' folders in several files and an index


def built(case: str, meta: bool) -> torch.nn.Module:
    config = parse_config(tiny_argv(tempfile.mkdtemp(), seed=SEED, **{**CASES, **SAVED}[case]))
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    return build_model(config, tokenizer, config.initial_blocks(), meta=meta)


def whole_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds whole (allocated, not partitioned)."""
    return sum(p.nbytes for p in model.parameters() if not p.is_meta and not hasattr(p, "ds_id"))


def partitioned(model: torch.nn.Module, config, fill_whole) -> tuple[int, int]:
    """Partition `model` through `partition_zero3` with `fill_whole(unit)`; returns (the most bytes held whole at
    once, this process's partition bytes)."""
    peak = 0

    def fill(unit):
        nonlocal peak
        assert whole_bytes(model) == 0  # every earlier group is partitioned
        fill_whole(unit)
        peak = max(peak, whole_bytes(model))

    partition_zero3(model, fill, config)
    return peak, sum(p.ds_tensor.nbytes for p in model.parameters())


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, from the processes' partitions (`zero3_full`: not a process's own whole copy of a small
    parameter, which DeepSpeed 0.19.0 was seen to leave wrong, timing-dependently)."""
    return {name: zero3_full(p).clone() for name, p in model.named_parameters()}


def differ(reference: dict, other: dict) -> list[str]:
    return sorted(set(reference) ^ set(other)) + [
        n for n in reference if n in other and not torch.equal(reference[n], other[n])
    ]


def meta_builds(rank: int, world_size: int) -> dict:
    out = {}
    for case in CASES:
        reference = dict(built(case, meta=False).named_parameters())
        model = built(case, meta=True)
        peak, mine = partitioned(model, ENGINE, lambda unit, m=model: materialize(m, SEED, keep=unit))
        out[case] = {
            "differ": differ(reference, gathered(model)),
            "all_partitioned": all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()),
            "whole": sum(t.nbytes for t in reference.values()),
            "largest_tensor": max(t.nbytes for t in reference.values()),
            "peak": peak,
            "mine": mine,
        }
    return out


def engine_path(rank: int, world_size: int) -> dict:
    """What `AccelerateEngine.__init__` and `build` do under configs/accelerate/deepspeed_zero3_offload.yaml (its
    parameters offloaded to CPU memory) before `accelerator.prepare`: Accelerate turns DeepSpeed off on a CPU run, so
    the Accelerator is a stand-in holding the plugin that `AcceleratorState` sets up (mixed precision, `select`)."""
    from accelerate.utils import DeepSpeedPlugin, DistributedType
    from transformers.integrations import is_deepspeed_zero3_enabled

    from hf_p2r.training.engines.accelerate import build_without_zero_init, zero3_config

    with mock.patch.dict(os.environ, launch_env("deepspeed_zero3_offload")):
        plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("no")
    # As Hugging Face's example configurations have it: Accelerate fills these in `prepare`, after the build.
    plugin.deepspeed_config["zero_optimization"] |= {
        "stage3_param_persistence_threshold": "auto",
        "reduce_bucket_size": "auto",
    }
    plugin.select(_from_accelerator_state=True)  # registers the configuration with transformers
    accelerator = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=plugin)
    )
    registered = is_deepspeed_zero3_enabled()
    config = zero3_config(accelerator)
    build_without_zero_init()
    whole = built("pseudo", meta=False)
    reference = dict(whole.named_parameters())
    model = materialize_zero3(built("pseudo", meta=True), SEED, config)
    args = parse_config(tiny_argv(tempfile.mkdtemp(), weight_decay=0.1)).train

    def groups(m: torch.nn.Module) -> list:  # the engine builds the optimizer on the partitions
        return [(group["weight_decay"], len(group["params"])) for group in build_optimizer(m, args).param_groups]

    return {
        "groups": groups(model),
        "whole_groups": groups(whole),
        "registered": registered,
        "unregistered": not is_deepspeed_zero3_enabled(),
        "offloaded": config["zero_optimization"]["offload_param"]["device"] == "cpu",
        "differ": differ(reference, gathered(model)),
        "all_partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
    }


class PeakOfPartition:
    """`partition_zero3` that records the most bytes held whole after each group's fill."""

    def __init__(self):
        self.peak = 0

    def __call__(self, model, fill, config=None, **kwargs):
        def watched(unit):
            fill(unit)
            self.peak = max(self.peak, whole_bytes(model))

        return partition_zero3(model, watched, config, **kwargs)


def delink_trains(rank: int, world_size: int) -> dict:
    """A ZeRO-3 engine on the partitioned meta build (1 block, 4 depths), delinked by `delink_deepspeed` to 2 blocks
    after one step and to the real model after two, against the same run in one process (the whole batch)."""
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(3, 101, (4, 12), generator=generator) for _ in range(4)]
    local = slice(rank * 2, rank * 2 + 2)
    reference = built("pseudo", meta=False).train()
    model = materialize_zero3(built("pseudo", meta=True), SEED, ENGINE).train()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ENGINE)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = {"blocks": [], "partitioned": [], "delink_peak": []}
    for step, input_ids in enumerate(data):
        if step in DELINKS:
            peak = PeakOfPartition()
            with mock.patch("hf_p2r.distributed.deepspeed.partition_zero3", peak):
                new = delink_deepspeed(engine, DELINKS[step])
            out["blocks"].append(len(new.model.layers))
            out["partitioned"].append(all(hasattr(p, "ds_id") for p in new.parameters()))
            out["delink_peak"].append(peak.peak)
            optimizer = torch.optim.SGD(new.parameters(), lr=LR)
            engine, *_ = deepspeed.initialize(model=new, optimizer=optimizer, config=ENGINE)
            reference.delink(DELINKS[step])
            reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
            delinked = {name: p.detach().clone() for name, p in reference.named_parameters()}
        engine.backward(engine(input_ids=input_ids[local], labels=input_ids[local]).loss)
        engine.step()
        reference(input_ids=input_ids, labels=input_ids).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    final = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    expected = dict(reference.named_parameters())
    out.update(
        names=sorted(final) == sorted(expected),
        real=engine.module.config.share_layers is False,
        max_diff=max((final[n] - p).abs().max().item() for n, p in expected.items()),
        moved=max((p - delinked[n]).abs().max().item() for n, p in expected.items()),  # since the last delink
        whole_real=sum(p.nbytes for p in expected.values()),
    )
    return out


def trainer_engine(rank: int, world_size: int, case: str = "pseudo") -> dict:
    """The Accelerate engine itself under configs/accelerate/deepspeed_zero3_offload.yaml's environment, in one
    process: Accelerate keeps DeepSpeed on a CPU run with `cpu: false` (it sets up no several processes there, hence
    one): `build` (meta model, partitions, optimizer, `accelerator.prepare`), a step, the delink, a step, `real/`."""
    from hf_p2r.training.engines import engine_for

    use_launch_env("deepspeed_zero3_offload")
    fields = {"cpu": "false", "mixed_precision": "no", "optimizer_carry": "reset", **CASES[case]}
    config = parse_config(tiny_argv(tempfile.mkdtemp(), seed=SEED, **fields))
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    reference = dict(built(case, meta=False).named_parameters())
    engine = engine_for(config)
    try:
        engine.build(build_model(config, tokenizer, config.initial_blocks(), meta=True), config.initial_blocks())
        params = dict(engine.model.module.named_parameters())
        whole = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in params.items()}
        input_ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(0))
        losses = [engine.forward_backward(input_ids).item()]
        engine.optimizer_step()
        engine.delink(None)
        losses.append(engine.forward_backward(input_ids).item())
        engine.optimizer_step()
        # real/ through the engine (each process its share: here the one process all) and through the gathered path
        folder, model = Path(tempfile.mkdtemp()), engine.accelerator.unwrap_model(engine.model)
        with mock.patch("hf_p2r.training.engines.accelerate.zero3_owned_state", wraps=zero3_owned_state) as shares:
            engine.save_model(folder / "real", tokenizer)
        save_model_gathered(engine.accelerator, model, tokenizer, folder / "real-g", engine.remote_code)
        return {
            "saved": same_folders(folder / "real", folder / "real-g") | {"from_shares": shares.call_count == 1},
            "type": engine.accelerator.distributed_type.value,
            "partitioned": all(hasattr(p, "ds_id") for p in params.values()),
            "differ": differ(reference, whole),
            "real": engine.accelerator.unwrap_model(engine.model).config.share_layers is False,
            "losses": losses,
        }
    finally:
        engine.release()  # not close(): its end_training would end the process group the spawner ends


def same_folders(first: Path, second: Path) -> dict:
    """{files: the same file names, bytes: every file equal byte for byte (the safetensors files, their index, the
    config, the tokenizer), count: how many}."""
    names = sorted(path.name for path in first.iterdir())
    same = names == sorted(path.name for path in second.iterdir())
    return {
        "files": same,
        "count": len(names),
        "bytes": same and all(filecmp.cmp(first / name, second / name, shallow=False) for name in names),
    }


def folders_from_partitions(rank: int, world_size: int) -> dict:
    """ZeRO-3 engines (pseudo, real, tied embeddings, pseudo under bf16) trained a step: the folder written from each
    process's share (`zero3_owned_state`, then `save_model_from_shards`) against the folder of the gathered path
    (Accelerate's `get_state_dict`, DeepSpeed's consolidated 16-bit state dict, written by the first process); and the
    shares."""
    from accelerate.utils import DistributedType

    folder = spawn.shared_folder()
    config = {**ENGINE, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    stand_in = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_config=config)
    tokenizer = load_tokenizer(parse_config(tiny_argv(tempfile.mkdtemp())).data.tokenizer_name)
    input_ids = torch.randint(3, 101, (4, 12), generator=torch.Generator().manual_seed(0))[rank * 2 : rank * 2 + 2]
    out = {}
    for case in ("pseudo", "real", "tied", "moe", "pseudo-bf16"):  # the last: DeepSpeed's bf16 (--mixed_precision bf16)
        config["bf16"] = {"enabled": case.endswith("-bf16")}
        model = materialize_zero3(built(case.removesuffix("-bf16"), meta=True), SEED, config).train()
        built_dtypes = sorted({str(p.dtype) for p in model.parameters()})
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
        )
        engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
        engine.step()
        owned = zero3_owned_state(engine.module)
        # (a parameter ZeRO-3 keeps whole on every process, `ds_persist`: the small ones, whole before the save too)
        partitioned = all(hasattr(p, "ds_id") and (p.numel() == 0 or p.ds_persist) for p in engine.module.parameters())
        cooperative, gathered_folder = Path(f"{folder}/{case}"), Path(f"{folder}/{case}-g")
        save_model_from_shards(engine.module, cooperative, owned, tokenizer=tokenizer, max_shard_size=SMALL_SHARDS,
                               progress=False)  # fmt: skip
        state_dict = Accelerator.get_state_dict(stand_in, engine)  # the gathered path's (None beside the first)
        if rank == 0:
            save_model(engine.module, gathered_folder, state_dict=state_dict, tokenizer=tokenizer,
                       max_shard_size=SMALL_SHARDS, progress=False)  # fmt: skip
        if case.endswith("-bf16"):  # the delink partitions the new model in the old one's dtype
            out["delinked-bf16"] = sorted({str(p.dtype) for p in delink_deepspeed(engine).parameters()})
        unique = {id(t): t for t in owned.values()}
        shares = [None] * world_size
        dist.all_gather_object(shares, (sum(t.nbytes for t in unique.values()), len(unique) < len(owned)))
        whole = {name: t for name, t in (state_dict or {}).items()}
        out[case] = {
            "dtypes": [built_dtypes, sorted({str(t.dtype) for t in owned.values() if t.is_floating_point()})],
            "partitioned": partitioned,
            "shares": [share for share, _ in shares],
            "whole": sum({t.data_ptr(): t.nbytes for t in whole.values()}.values()),
            "largest": max((t.nbytes for t in whole.values()), default=0),
            "tied_once": any(tied for _, tied in shares),  # a process holds one tensor under two names
        }
        if rank == 0:
            out[case] |= same_folders(cooperative, gathered_folder)
        dist.barrier()
    return out


# One two-process run for every two-process check of the file (the processes' start-up, DeepSpeed's import and its
# process group included, is paid once). The engine path runs last: it registers DeepSpeed's configuration with
# transformers (and drops it again), which the other bodies must not see.
two = spawn.shared_run(
    {"builds": meta_builds, "delink": delink_trains, "written": folders_from_partitions, "engine_path": engine_path}, 2
)


@pytest.fixture(scope="module")
def builds(two) -> dict:
    return two["builds"]


@pytest.fixture(scope="module")
def written(two) -> dict:
    return two["written"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero3_partitions_gather_to_the_one_process_initialisation_bitwise(builds, case):
    run = builds[case]
    assert run["differ"] == [] and run["all_partitioned"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero3_build_never_holds_more_than_one_module_whole(builds, case):
    run = builds[case]
    assert 0 < run["peak"] <= 2 * run["largest_tensor"]  # one module (a linear and its bias, a tied pair) at a time
    assert run["peak"] < 0.5 * run["whole"]
    assert 0.45 * run["whole"] <= run["mine"] <= 0.55 * run["whole"]  # its half (padded) of every parameter


def test_engine_builds_on_meta_and_partitions_under_accelerates_zero3_plugin(two):
    run = two["engine_path"]
    assert run["registered"] and run["unregistered"]  # Accelerate's registration, then the engine's drop of it
    assert run["offloaded"]
    assert run["differ"] == [] and run["all_partitioned"]
    # The optimizer's groups as on the whole model: weight decay on the matrices (a partition is held flat)
    assert run["groups"] == run["whole_groups"] and {decay for decay, _ in run["groups"]} == {0.0, 0.1}


def test_delinks_of_a_zero3_engine_partition_the_new_model_and_train_like_one_process(two):
    run = two["delink"]
    assert run["blocks"] == [2, 4] and run["partitioned"] == [True, True] and run["names"] and run["real"]
    assert all(0 < peak < 0.5 * run["whole_real"] for peak in run["delink_peak"])  # one module whole at a time
    assert run["moved"] > 100 * ATOL  # control: training moved the weights far beyond the tolerance
    assert run["max_diff"] < ATOL


@pytest.mark.parametrize("case", ["pseudo", "moe"])
def test_the_engine_builds_steps_and_delinks_under_accelerates_zero3_offload_plugin(tmp_path, case):
    run = spawn.run(functools.partial(trainer_engine, case=case), 1, tmp_path)
    assert run["type"] == "DEEPSPEED" and run["partitioned"] and run["differ"] == [] and run["real"]
    assert all(0 < loss < 10 for loss in run["losses"])  # finite losses of a 257-token vocabulary's model
    saved = run["saved"]  # real/ written from the shares, as the gathered path (Accelerate's get_state_dict) writes it
    assert saved["from_shares"] and saved["files"] and saved["bytes"] and saved["count"] >= 3, saved


def test_accelerate_launch_with_the_zero3_offload_config_trains_as_one_plain_process_until_the_optimizer_restarts(
    tmp_path,
):
    """The trainer under `accelerate launch --config_file configs/accelerate/deepspeed_zero3_offload.yaml` (one process,
    `cpu: false`) against the plain one-process run, through the pseudo stage and the first step after the delink: the
    same steps, stages, delink and learning rates, bitwise; the same gradient norms to 1e-6 (relative); the same
    losses, bitwise while every earlier gradient norm agreed bitwise, to 1e-6 after one did not. After that step they
    part by design: DeepSpeed restarts the whole optimizer state at the delink, while `optimizer_carry: reset` keeps
    the state of the parameters outside the blocks in one process.

    Why the norms carry a tolerance: the gradients are the same, but the two runs take their norm in different ways.
    torch's `clip_grad_norm_` (the plain run) takes each parameter's norm in fp32 and then the fp32 norm of those;
    DeepSpeed ZeRO-3 with an offloaded optimizer sums the squared per-parameter norms in fp64, per parameter group,
    rounds the sum to fp32 and takes its root there, then combines the groups' norms. Each is within about an fp32 ulp
    (1.2e-7) of the exact norm, and they agree bitwise only by chance. Measured on the plain run's own gradients (AVX2,
    one thread, both formulas side by side): steps 1-3 agree bitwise, step 4 (the first after the delink, two parameter
    groups instead of four) gives 1.471272587776184 (torch) against 1.4712724685668945 (DeepSpeed's formula; exactly
    the ZeRO-3 run's logged norm), the exact fp64 norm being 1.47127249525: DeepSpeed's is the fp32 nearest, torch's
    one ulp off. With another vector width (ATEN_CPU_CAPABILITY=default) step 1 already differs by one ulp. A norm that
    differs changes the clipping factor 1/(norm + 1e-6) in its last bit, so the losses after it agree to rounding;
    while the norms agree, both runs clip and step (AdamW, elementwise) the same numbers, and the losses are bitwise."""
    fields = {"seed": SEED, "mixed_precision": "no", "optimizer_carry": "reset", "pseudo_steps": 3, "real_steps": 3}
    fields["eval_steps"] = 0
    config = str(REPO / "configs/accelerate/deepspeed_zero3_offload.yaml")
    launch = [ACCELERATE, "launch", "--config_file", config, "--num_processes", "1", "--main_process_port", "0"]
    argv = [*launch, "-m", "hf_p2r.train", *tiny_argv(tmp_path / "zero3", **fields, cpu="false")]
    done = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"zero3: {done.stderr[-3000:]}"
    assert train(parse_config(tiny_argv(tmp_path / "plain", **fields))) == 0  # the plain run, in this process
    plain, zero3 = (trajectory(tmp_path / name) for name in ("plain", "zero3"))
    steps = [record["step"] for record in zero3 if "loss" in record]
    assert steps == [1, 2, 3, 4, 5, 6] and (tmp_path / "zero3" / "real" / "config.json").is_file()
    first_after_delink = [index for index, record in enumerate(plain) if record.get("step") == 4][0]
    plain, zero3 = plain[: first_after_delink + 1], zero3[: first_after_delink + 1]
    rounded = ("loss", "grad_norm")
    assert [{k: v for k, v in r.items() if k not in rounded} for r in zero3] == [
        {k: v for k, v in r.items() if k not in rounded} for r in plain
    ]  # steps, stages, the delink event and every learning rate, bitwise
    assert [r.keys() & set(rounded) for r in zero3] == [r.keys() & set(rounded) for r in plain]
    same_updates = True  # every earlier norm bitwise: the same clipped AdamW steps, so the same weights
    for step, (ours, theirs) in enumerate(zip(zero3, plain, strict=True)):
        if "loss" in theirs:
            expected = theirs["loss"] if same_updates else pytest.approx(theirs["loss"], rel=1e-6)
            assert ours["loss"] == expected, (step, ours, theirs, same_updates)
        if "grad_norm" in theirs:
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6), (step, ours, theirs)
            same_updates = same_updates and ours["grad_norm"] == theirs["grad_norm"]


@pytest.mark.parametrize("case", ["pseudo", "real", "tied", "moe", "pseudo-bf16"])
def test_zero3_folder_written_from_partitions_equals_the_gathered_folder_byte_for_byte(written, case):
    run = written[case]
    # the partitions (as zero.Init builds a model under the configuration) and the shares in the run's dtype
    dtype = "torch.bfloat16" if case.endswith("-bf16") else "torch.float32"
    assert run["dtypes"] == [[dtype], [dtype]]
    if case.endswith("-bf16"):
        assert written["delinked-bf16"] == [dtype]
    assert run["partitioned"]  # the engine's parameters stay partitioned: nothing was gathered for good
    assert run["files"] and run["bytes"] and run["count"] >= 4, run  # several safetensors files, index, config...


@pytest.mark.parametrize("case", ["pseudo", "real", "tied", "moe"])
def test_zero3_save_gives_each_process_a_share_of_the_model_not_all_of_it(written, case):
    run = written[case]
    assert sum(run["shares"]) == run["whole"]  # every tensor kept by exactly one process
    # balanced by bytes: at most half the model plus one tensor (the greedy bound), about half here
    assert all(share <= run["whole"] / 2 + run["largest"] for share in run["shares"])
    assert all(0.45 * run["whole"] <= share <= 0.55 * run["whole"] for share in run["shares"])  # 0.50 measured
    assert run["tied_once"] == (case == "tied")  # the tied embeddings: one copy under both names
