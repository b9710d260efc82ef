"""Regional compilation (`compile_blocks`, trainer field `compile`): one graph per block class, no graph break, no
recompilation across depths, steps or a delink, and the eager model's losses and gradients.

Most tests use the `aot_eager` backend (dynamo's graph and AOTAutograd's joint graph, run by eager kernels: the same
capture as inductor, without its code generation, which takes minutes on two cores); one test runs inductor.
Tolerances: aot_eager runs the same kernels in the same order as eager, so losses and gradients agree to fp32
rounding (rtol 1e-5, atol 1e-6), except under bf16 autocast, where AOTAutograd's graph rounds some intermediate
gradients to bf16 at other points than eager (seen: 2^-8 relative, one bf16 step; allowed rtol 1.6e-2, atol 1e-4);
inductor fuses and reorders reductions (rtol 1e-4, atol 1e-5).
"""

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from transformers import AutoModelForCausalLM

from hf_p2r.compat import dynamo_counters
from hf_p2r.models.p2r import P2RConfig, P2RMoeConfig
from hf_p2r.training import parse_config, train
from hf_p2r.training.compile import compile_blocks
from hf_p2r.training.metrics import read_metrics

from ..distributed import spawn
from .helpers import loss_and_grads, run_on_every_process, tiny_argv, trajectory

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
EXACT = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-4)


def tiny_model(depth=6, blocks=1, moe=False, checkpointing=False, seed=0):
    torch.manual_seed(seed)
    if moe:
        config = P2RMoeConfig(
            **SHAPE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=depth
        )
    else:
        config = P2RConfig(**SHAPE, num_hidden_layers=depth)
    if blocks < depth:
        config = type(config)(**{**config.to_dict(), "share_layers": True, "num_unique_layers": blocks})
    model = AutoModelForCausalLM.from_config(config).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    return model


class Graphs:
    """Dynamo's counters from a fresh start (`torch.compiler.reset`): graphs compiled, graph breaks, recompiles."""

    def __init__(self):
        torch.compiler.reset()
        self.before = dynamo_counters()

    def delta(self, group: str) -> dict:
        now, before = dynamo_counters().get(group, {}), self.before.get(group, {})
        return {key: value - before.get(key, 0) for key, value in now.items() if value != before.get(key, 0)}

    @property
    def unique(self) -> int:
        return self.delta("stats").get("unique_graphs", 0)


def assert_same(compiled, eager, tolerance=EXACT):
    (outputs, grads), (expected, expected_grads) = compiled, eager
    torch.testing.assert_close(outputs.loss, expected.loss, **tolerance)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], expected_grads[name], **tolerance, msg=lambda text, name=name: f"{name}: {text}"
        )


def test_a_shared_block_compiles_once_for_every_depth_and_step():
    """A 6-deep pseudo model with one block: one graph, no break, no recompile, over 3 steps; eager's numbers."""
    model, ids = tiny_model(depth=6, blocks=1), torch.randint(0, 64, (2, 16))
    eager = copy.deepcopy(model)
    graphs = Graphs()
    compile_blocks(model, backend="aot_eager")
    for _ in range(3):
        assert_same(loss_and_grads(model, ids), loss_and_grads(eager, ids))
    assert graphs.unique == 1
    assert graphs.delta("graph_break") == {} and graphs.delta("recompiles") == {}


@pytest.mark.processes  # inductor runs a C++ compiler
def test_inductor_compiles_the_blocks_once_and_matches_eager():
    model, ids = tiny_model(depth=3, blocks=3), torch.randint(0, 64, (2, 8))
    eager = copy.deepcopy(model)
    graphs = Graphs()
    compile_blocks(model)  # inductor
    for _ in range(2):
        assert_same(loss_and_grads(model, ids), loss_and_grads(eager, ids), dict(rtol=1e-4, atol=1e-5))
    assert graphs.unique == 1 and graphs.delta("graph_break") == {}


def test_moe_with_activation_checkpointing_keeps_router_logits_and_hidden_states():
    """An MoE pseudo model under activation checkpointing: the router's logits (recorded by a hook inside the
    block) and the hidden states are captured once per depth, the aux loss is the same, one graph for every depth
    and the checkpoint's recompute."""
    model, ids = tiny_model(depth=4, blocks=1, moe=True, checkpointing=True), torch.randint(0, 64, (2, 16))
    eager = copy.deepcopy(model)
    graphs = Graphs()
    compile_blocks(model, backend="aot_eager")
    for _ in range(2):
        compiled = loss_and_grads(model, ids, output_router_logits=True, output_hidden_states=True)
        expected = loss_and_grads(eager, ids, output_router_logits=True, output_hidden_states=True)
        assert_same(compiled, expected)
        torch.testing.assert_close(compiled[0].aux_loss, expected[0].aux_loss, **EXACT)
        assert len(compiled[0].router_logits) == len(expected[0].router_logits) == 4
        assert len(compiled[0].hidden_states) == len(expected[0].hidden_states) == 5
        for got, want in zip(compiled[0].router_logits, expected[0].router_logits):
            torch.testing.assert_close(got, want, **EXACT)
    assert graphs.unique == 1 and graphs.delta("graph_break") == {} and graphs.delta("recompiles") == {}


def test_mixed_precision_compiles_once_under_autocast():
    model, ids = tiny_model(depth=4, blocks=2), torch.randint(0, 64, (2, 16))
    eager = copy.deepcopy(model)
    graphs = Graphs()
    compile_blocks(model, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            assert_same(loss_and_grads(model, ids), loss_and_grads(eager, ids), BF16)
    assert graphs.unique == 1 and graphs.delta("graph_break") == {}


def test_a_delink_reuses_the_compiled_graph():
    """1 block at 4 depths -> delinked to 2 -> 4 (real): every model of the run on the one graph, eager's numbers."""
    model, ids = tiny_model(depth=4, blocks=1), torch.randint(0, 64, (2, 16))
    eager = copy.deepcopy(model)
    graphs = Graphs()
    compile_blocks(model, backend="aot_eager")
    for blocks in (1, 2, None):
        if blocks != 1:
            model.delink(blocks), eager.delink(blocks)
            compile_blocks(model, backend="aot_eager")  # what the engines do after a delink
        assert_same(loss_and_grads(model, ids), loss_and_grads(eager, ids))
    assert len(model.model.layers) == 4
    assert graphs.unique == 1 and graphs.delta("recompiles") == {}


def wrapped_compiled_vs_eager(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from hf_p2r.distributed import fully_shard_p2r

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1)).chunk(world_size)[rank]
    result = {}
    for wrap in ("ddp", "fsdp2"):
        for name in ("eager", "compiled"):
            model = tiny_model(depth=4, blocks=2)
            graphs = Graphs()
            if name == "compiled":
                compile_blocks(model, backend="aot_eager")  # then wrap or shard, as torchtitan orders it
            if wrap == "ddp":
                wrapped = DistributedDataParallel(model)
            else:
                wrapped = fully_shard_p2r(model, mesh=init_device_mesh("cpu", (world_size,)))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(2):
                loss = wrapped(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step(), optimizer.zero_grad()
                losses.append(loss.item())
            result[f"{wrap}/{name}"] = losses
            result[f"{wrap}/{name}_graphs"] = graphs.unique
    return result


def test_ddp_and_fsdp2_wrap_the_compiled_blocks(tmp_path):
    """Two processes: DDP's gradient hooks and FSDP2's (all-gather, reshard, the shared block's gather-once) run
    around the compiled forward; the second step's loss shows the first step's update was the eager one."""
    result = spawn.run(wrapped_compiled_vs_eager, 2, tmp_path)
    for wrap in ("ddp", "fsdp2"):
        assert result[f"{wrap}/compiled_graphs"] == 1
        assert result[f"{wrap}/compiled"] == pytest.approx(result[f"{wrap}/eager"], rel=1e-5)


# L=4, k=1 -> 2 blocks at step 2 -> 4 (real) at step 4, then 2 real steps.
SCHEDULE = dict(pseudo_steps=4, real_steps=2, partial_delink_steps=[2], partial_delink_blocks=[2], eval_steps=0)


@pytest.mark.parametrize(
    ("extra", "expected_graphs"),
    [
        ({}, 2),
        ({"offload": "0.5", "mixed_precision": "bf16", "activation_checkpointing": "true"}, 4),
        # offload auto measures the activations with a training forward: it ran with a KV cache, which recompiled the
        # block at every depth and hit torch's recompile limit under fullgraph (the GPU report's bf16 trainer run,
        # 8 layers, H200). The budget keeps the pseudo model resident and offloads a block of the real one. A third
        # graph: the measurement's forward of one sequence (the training forward's shape is the micro-batch's).
        ({"offload": "auto", "offload_budget_gb": "0.002"}, 3),
    ],
    ids=["fp32", "bf16-offload-checkpointing", "offload-auto"],
)
def test_the_trainer_with_compile_follows_the_eager_run_through_the_delinks(tmp_path, extra, expected_graphs):
    """A tiny run, 1 -> 2 -> 4 blocks, compiled and eager: the same losses and validation losses (bf16: within
    autocast's rounding), no graph break, no recompilation across depths, steps or delinks. Its graphs: one for the
    training forward (grad mode, reused by the checkpoint's recompute) and one for the validation forwards (no grad);
    with offload twice that, as the offloaded blocks run on bf16 working copies and the resident ones on fp32
    weights (another parameter dtype: other code)."""
    runs = {}
    for compiled in (False, True):
        output_dir = tmp_path / f"compile-{compiled}"
        fields = {**SCHEDULE, **extra, **({"compile": "true", "compile_backend": "aot_eager"} if compiled else {})}
        graphs = Graphs()
        try:
            assert train(parse_config(tiny_argv(output_dir, **fields))) == 0
        finally:  # Accelerate's process-wide state keeps its mixed precision (test_mixed_precision_offload's reset)
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        runs[compiled] = read_metrics(output_dir / "metrics.jsonl"), graphs
    (compiled, graphs), (eager, _) = runs[True], runs[False]
    losses = [[r[k] for r in run if k in r] for run in (compiled, eager) for k in ("loss", "val_loss")]
    assert len(losses[0]) == 6  # a loss at every step
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-4, atol=0.0)  # (bf16 autocast: rounding of 8 bits)
    torch.testing.assert_close(losses[1], losses[3], rtol=1e-4, atol=0.0)
    assert graphs.unique == expected_graphs and graphs.delta("graph_break") == {} and graphs.delta("recompiles") == {}


def plain_and_compiled_runs(folder: str, rank: int, world_size: int) -> dict:
    """The trainer in two gloo processes (DDP), plain and with compile (aot_eager) and the chunked loss: each run's
    trajectory, and what dynamo compiled in the second on each process (graphs, graph breaks, recompiles)."""
    fields = dict(pseudo_steps=2, real_steps=2, eval_steps=2, mixed_precision="no")
    run_on_every_process(folder, "plain", fields)
    graphs = Graphs()
    run_on_every_process(
        folder, "fast", {**fields, "compile": "true", "compile_backend": "aot_eager", "loss_kernel": "chunked"}
    )
    compiled = [None] * world_size
    dist.all_gather_object(compiled, [graphs.unique, graphs.delta("graph_break"), graphs.delta("recompiles")])
    return {name: trajectory(f"{folder}/{name}") for name in ("plain", "fast")} | {"compiled": compiled}


@pytest.mark.slow
def test_two_data_parallel_processes_with_compiled_blocks_and_the_chunked_loss_follow_the_plain_run(tmp_path):
    """Two CPU processes (DDP over gloo), 1 -> 4 blocks: compile (aot_eager) and loss_kernel chunked against neither,
    loss, gradient norm and validation loss at every step; the engine compiles the delinked blocks again, and dynamo
    compiles two graphs per process in the whole run (the training forward and the validation forward), none after
    the delinks: no graph break, no recompilation. (Accelerate runs FSDP only on GPUs: with the FSDP2 config a CPU run
    is DDP, so FSDP2 around the compiled blocks is test_ddp_and_fsdp2_wrap_the_compiled_blocks, on fully_shard.)"""
    runs = spawn.run(partial(plain_and_compiled_runs, str(tmp_path)), 2, tmp_path)
    fast, plain = runs["fast"], runs["plain"]
    assert [r.get("event") for r in fast] == [r.get("event") for r in plain] and len(fast) == 6
    for key in ("loss", "grad_norm", "val_loss"):
        got, want = ([r[key] for r in run if key in r] for run in (fast, plain))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    assert runs["compiled"] == [[2, {}, {}], [2, {}, {}]]  # each process: 2 graphs, no break, no recompile
