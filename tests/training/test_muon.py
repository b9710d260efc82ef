"""`optimizer: muon`: MuonAdamW equals torch's Muon and AdamW side by side, an MoE block's experts one Newton–Schulz
matrix each, its state round-trips, the delink's three carries of Muon's momentum buffer value by value, offload,
the refusals (sharded matrices), and the trainer: a run through both delinks resumed bitwise, an MoE run, and two DDP
processes against one."""

import copy
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from hf_p2r.training import TrainArguments, delink_with_optimizer, parse_config, train
from hf_p2r.training.config import ConfigError
from hf_p2r.training.offload import GranularOffload
from hf_p2r.training.optim import (
    MuonAdamW,
    build_optimizer,
    check_optimizer_supported,
    muon_parameters,
    optimizer_factory,
    set_learning_rate,
)

from ..conftest import tiny_model
from ..distributed import spawn
from .helpers import TWO_DELINKS, run_on_every_process, tiny_argv, trained_run, trajectory

MUON = dict(optimizer="muon", weight_decay=0.1, learning_rate=1e-2, muon_learning_rate=2e-2)
IDS = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))


def _steps(model, optimizer, steps: int = 3, lr: float = 1e-2) -> None:
    for _ in range(steps):
        set_learning_rate(optimizer, lr)
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model(share_layers=True, num_unique_layers=2)
    optimizer = build_optimizer(model, TrainArguments(**MUON, shared_lr_scale="depth"))
    assert isinstance(optimizer, MuonAdamW)
    algorithm = {id(p): group["algorithm"] for group in optimizer.param_groups for p in group["params"]}
    scale = {id(p): group["lr_scale"] for group in optimizer.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        hidden_matrix = ".layers." in name and param.ndim == 2
        assert algorithm[id(param)] == ("muon" if hidden_matrix else "adamw"), name
        # tiny_model: 8 depths over 2 blocks, so a block runs at 4: its rate is / 4, Muon's also x 2 (2e-2 / 1e-2).
        expected = (2.0 if hidden_matrix else 1.0) * (0.25 if ".layers." in name else 1.0)
        assert scale[id(param)] == expected, name
    assert {name for name, _ in model.named_parameters() if name.startswith(("lm_head", "model.embed"))}.isdisjoint(
        name for name, param in model.named_parameters() if id(param) in muon_parameters(model)
    )


def test_muon_adamw_steps_exactly_as_torch_muon_and_adamw_side_by_side():
    model = tiny_model().train()
    reference = copy.deepcopy(model)
    args = TrainArguments(**MUON)
    optimizer = build_optimizer(model, args)
    names = {name for name, param in model.named_parameters() if id(param) in muon_parameters(model)}
    params = dict(reference.named_parameters())
    muon = torch.optim.Muon(
        [params[name] for name in sorted(names, key=list(params).index)],
        lr=2e-2,
        weight_decay=0.1,
        momentum=args.muon_momentum,
        adjust_lr_fn=args.muon_adjust_lr_fn,
    )
    rest = [param for name, param in params.items() if name not in names]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=True,
    )
    _steps(model, optimizer)
    for _ in range(3):
        reference(IDS, labels=IDS).loss.backward()
        for inner in (muon, adamw):
            inner.step()
            inner.zero_grad()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, expected), name
    muon_params = [param for param in model.parameters() if id(param) in muon_parameters(model)]
    assert all(optimizer.state[param].keys() == {"momentum_buffer"} for param in muon_params)


def test_experts_are_orthogonalized_one_matrix_each():
    """A 3-D (experts, out, in) tensor steps as torch's Muon over one parameter per expert; one buffer like it."""
    weight = torch.nn.Parameter(torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0)))
    experts = [torch.nn.Parameter(weight.detach()[e].clone()) for e in range(3)]
    optimizer = MuonAdamW([{"params": [weight], "algorithm": "muon"}], lr=0.1, adjust_lr_fn="match_rms_adamw")
    reference = torch.optim.Muon(experts, lr=0.1, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    for seed in range(3):
        weight.grad = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(seed + 1))
        for e, expert in enumerate(experts):
            expert.grad = weight.grad[e].clone()
        optimizer.step()
        reference.step()
    buffer = optimizer.state[weight]["momentum_buffer"]
    assert buffer.shape == weight.shape
    for e, expert in enumerate(experts):
        assert torch.equal(weight.detach()[e], expert.detach())
        assert torch.equal(buffer[e], reference.state[expert]["momentum_buffer"])
    # Control: the three experts orthogonalized as one (18, 4) matrix step elsewhere, so the test tells them apart.
    start = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0))
    whole = torch.nn.Parameter(start.reshape(18, 4).clone())
    stacked = torch.optim.Muon([whole], lr=0.1, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    for seed in range(3):
        whole.grad = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(seed + 1)).reshape(18, 4)
        stacked.step()
    assert not torch.allclose(whole.detach().reshape(3, 6, 4), weight.detach())


def test_an_moe_models_experts_go_to_muon_per_expert():
    from hf_p2r import P2RMoeConfig, P2RMoeForCausalLM

    config = P2RMoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    model = P2RMoeForCausalLM(config).train()
    optimizer = build_optimizer(model, TrainArguments(**MUON))
    muon = muon_parameters(model)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(p.ndim == 3 and id(p) in muon for p in experts)
    _steps(model, optimizer, steps=2)
    assert all(optimizer.state[p]["momentum_buffer"].shape == p.shape for p in experts)


def test_state_dict_round_trips_and_the_next_step_is_the_same():
    model = tiny_model().train()
    args = TrainArguments(**MUON)
    optimizer = build_optimizer(model, args)
    _steps(model, optimizer, steps=2)
    saved = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    restored = build_optimizer(twin, args)
    restored.load_state_dict(saved)
    assert restored.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    _steps(model, optimizer, steps=2)
    _steps(twin, restored, steps=2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def _trained_muon(**model_overrides):
    model = tiny_model(share_layers=True, **model_overrides).train()
    optimizer = build_optimizer(model, TrainArguments(**MUON))
    _steps(model, optimizer, steps=2)
    snapshot = {
        name: {key: value.clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }
    return model, optimizer, snapshot


@pytest.mark.parametrize("blocks", [2, None])  # cycle, L=8: 1 block -> 2 (r = 4 / 8), or -> 8 real (r = 1 / 8)
@pytest.mark.parametrize("carry", ["reset", "copy", "scale"])
def test_delink_carries_muons_momentum_buffer_per_mode(carry, blocks):
    model, optimizer, before = _trained_muon(num_hidden_layers=8, num_unique_layers=1)
    new_optimizer = delink_with_optimizer(model, optimizer, blocks, carry, optimizer_factory(TrainArguments(**MUON)))
    assert isinstance(new_optimizer, MuonAdamW)
    ratio = (8 / (blocks or 8)) / 8
    muon = muon_parameters(model)
    for name, param in model.named_parameters():
        parts = name.split(".")
        source = ".".join([*parts[:2], "0", *parts[3:]]) if parts[1] == "layers" else name
        old, state = before[source], new_optimizer.state.get(param, {})
        if ".layers." not in name or carry == "copy":
            expected = old
        elif carry == "reset":
            expected = {}
        elif id(param) in muon:
            expected = {"momentum_buffer": old["momentum_buffer"] * ratio}
        else:  # a block's norm: AdamW's rule
            expected = {
                "step": old["step"],
                "exp_avg": old["exp_avg"] * ratio,
                "exp_avg_sq": old["exp_avg_sq"] * ratio**2,
            }
        assert state.keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(state[key], value), (name, key)
    if carry != "reset":  # each copy owns its buffer
        first, second = model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight
        assert new_optimizer.state[first]["momentum_buffer"].data_ptr() != (
            new_optimizer.state[second]["momentum_buffer"].data_ptr()
        )


def test_muons_carries_give_different_next_updates():
    """Control: the three carries are not equivalent under Muon, so the value test above tells real behaviour."""
    updates = {}
    for carry in ("reset", "copy", "scale"):
        model, optimizer, _ = _trained_muon(num_hidden_layers=8, num_unique_layers=1)
        new_optimizer = delink_with_optimizer(model, optimizer, None, carry, optimizer_factory(TrainArguments(**MUON)))
        weight = model.model.layers[5].mlp.up_proj.weight
        before = weight.detach().clone()
        _steps(model, new_optimizer, steps=1)
        updates[carry] = weight.detach() - before
    assert not torch.allclose(updates["reset"], updates["copy"])
    assert not torch.allclose(updates["copy"], updates["scale"])


def test_offloaded_blocks_step_muon_on_their_host_masters():
    """Granular offload: the offloaded blocks' matrices are in Muon groups, on the CPU, and the updates equal those of
    the same model without offload (on this CPU machine the compute device is the CPU too)."""
    model, plain = tiny_model().train(), tiny_model().train()
    args = TrainArguments(**MUON)
    offload = GranularOffload(model, [1, 3])
    optimizer = build_optimizer(model, args, offload)
    assert isinstance(optimizer, MuonAdamW)
    offloaded = {id(p) for p in offload.offloaded_parameters}
    on_muon = [p for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"] if id(p) in offloaded]
    assert on_muon and all(p.device.type == "cpu" for p in on_muon)
    _steps(model, optimizer, steps=2)
    _steps(plain, build_optimizer(plain, args), steps=2)
    offload.remove()
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_muon_is_refused_where_the_optimizer_gets_shards(kind):
    accelerator = SimpleNamespace(distributed_type=kind)
    with pytest.raises(ConfigError, match=r"^optimizer: muon orthogonalizes each matrix whole .*use optimizer: adamw"):
        check_optimizer_supported(accelerator, "muon")
    check_optimizer_supported(accelerator, "adamw")
    check_optimizer_supported(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU), "muon")


def test_a_flat_tensor_in_a_muon_group_is_one_line():
    flat = torch.nn.Parameter(torch.zeros(12))  # what DeepSpeed's ZeRO would hand over
    with pytest.raises(ConfigError, match=r"^optimizer: muon takes matrices \(2-D, or 3-D experts\), got a 1-D"):
        MuonAdamW([{"params": [flat], "algorithm": "muon"}])


SCHEDULE = dict(TWO_DELINKS, save_steps=1)  # the trainer's run; a checkpoint every step


muon_run = trained_run("muon_run", **SCHEDULE, optimizer="muon")


@pytest.mark.parametrize("resume_step", [2, 5])  # at the partial delink, and in the real stage
def test_the_trainer_runs_muon_through_both_delinks_and_resumes_exactly(muon_run, tmp_path, resume_step):
    output_dir = tmp_path / "run"
    shutil.copytree(muon_run, output_dir)
    checkpoint = output_dir / "checkpoints" / f"checkpoint-{resume_step}"
    argv = tiny_argv(output_dir, **SCHEDULE, optimizer="muon", resume_from_checkpoint=checkpoint)
    assert train(parse_config(argv)) == 0
    assert trajectory(output_dir) == trajectory(muon_run)  # every loss, learning rate and gradient norm, bitwise


def test_the_trainers_muon_run_differs_from_adamw(muon_run, tmp_path):
    """Control: the field reaches the optimizer (the same run under AdamW has other losses)."""
    assert train(parse_config(tiny_argv(tmp_path / "adamw", **SCHEDULE))) == 0
    losses = [[r["loss"] for r in trajectory(run) if "loss" in r] for run in (muon_run, tmp_path / "adamw")]
    assert losses[0][0] == losses[1][0] and losses[0][1:] != losses[1][1:]


def test_an_moe_run_under_muon_delinks_and_resumes_exactly(tmp_path):
    """MoE: the experts' 3-D tensors on Muon (one matrix per expert) through the trainer's delink, resumed bitwise."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.01)
    fields = dict(**moe, optimizer="muon", num_unique_layers=2, pseudo_steps=2, real_steps=2, save_steps=1)
    output_dir = tmp_path / "moe"
    assert train(parse_config(tiny_argv(output_dir, **fields))) == 0
    full = trajectory(output_dir)
    assert [r["step"] for r in full if "loss" in r] == [1, 2, 3, 4]
    resume = output_dir / "checkpoints" / "checkpoint-3"
    assert train(parse_config(tiny_argv(output_dir, **fields, resume_from_checkpoint=resume))) == 0
    assert trajectory(output_dir) == full


def _two_ddp_processes(folder: str, rank: int, world_size: int) -> dict:
    """The trainer under Muon in two gloo processes (DDP, 2 blocks each), then resumed from its checkpoint at the
    partial delink: the trajectory of each run."""
    fields = dict(**SCHEDULE, optimizer="muon", per_device_batch_size=2)
    run_on_every_process(folder, "ddp", fields)
    two = trajectory(Path(folder) / "ddp")
    run_on_every_process(folder, "ddp", fields, checkpoint=2)
    return {"two": two, "resumed": trajectory(Path(folder) / "ddp")}


DDP_TOLERANCE = {"loss": 1e-5, "val_loss": 1e-5, "grad_norm": 1e-4}


@pytest.mark.slow
def test_two_ddp_processes_under_muon_match_one_process_through_the_delinks(muon_run, tmp_path):
    """DDP (2 gloo processes of 2 blocks each) under Muon against the one-process run of 4 blocks:
    DDP averages the gradients before the step, so each process orthogonalises the same whole matrices; the only
    difference is the order of floating-point sums in the averaged gradient, which torch's Newton-Schulz (run in
    bfloat16) amplifies: measured at most 1.3e-6 relative in the losses and 2.1e-5 in the gradient norms over the 7
    steps. The tolerances stay far below what one step changes (~1e-2), so a process stepping its own gradient, or
    Newton-Schulz run on a part of a matrix, fails them. Then the two-process run resumes from its checkpoint at the
    partial delink, bitwise."""
    runs = spawn.run(partial(_two_ddp_processes, str(tmp_path)), 2, tmp_path)
    one, two = trajectory(muon_run), runs["two"]
    assert [(r["step"], r.get("event")) for r in one] == [(r["step"], r.get("event")) for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=DDP_TOLERANCE[key]), (a["step"], key)
    assert runs["resumed"] == two
