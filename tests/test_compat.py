"""hf_p2r.compat: each private read works on the releases installed (.ci/run runs this on the floors and the newest)."""

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_p2r.compat import (
    dcp_reader,
    forget_preparation,
    in_backward,
    initialize_pipeline_stage,
    local_tensor,
    parse_size_to_int,
    pipeline_stage_backward,
    pipeline_stage_stashed_graphs,
    prepared_models,
    reshard_after_backward,
    tensor_version,
)

from .distributed import spawn

# The compatibility pass (Makefile COMPAT_TESTS) runs this file on the declared floors and the newest releases too:
# every private torch/transformers read of hf_p2r/compat.py, its multi-process checks included.
pytestmark = pytest.mark.versions


def read_reshard_after_backward(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    block, empty = nn.Linear(4, 4), nn.Module()
    fully_shard(block, mesh=mesh)
    fully_shard(empty, mesh=mesh)
    seen = [reshard_after_backward(block)]
    for value in (False, True):
        block.set_reshard_after_backward(value)
        seen.append(reshard_after_backward(block))
    return {"seen": seen, "empty": reshard_after_backward(empty)}


def test_reshard_after_backward_reads_what_the_setter_wrote(tmp_path):
    result = spawn.run(read_reshard_after_backward, 1, tmp_path)
    assert result == {"seen": [True, False, True], "empty": True}


def test_in_backward_is_true_only_while_autograd_runs_a_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(in_backward())
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_parse_size_to_int_reads_huggingface_hub_sizes():
    assert parse_size_to_int("5GB") == 5 * 10**9
    assert parse_size_to_int("500MB") == 500 * 10**6


def test_deferred_auto_entries_load_on_lookup_and_match_classes_by_module_and_name():
    import collections

    from transformers.models.auto.auto_factory import _LazyAutoMapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_p2r.compat import defer_auto_registration

    mapping = _LazyAutoMapping(CONFIG_MAPPING_NAMES, collections.OrderedDict())
    config_path = "hf_p2r.models.p2r.configuration_p2r:P2RConfig"
    defer_auto_registration(mapping, {config_path: "collections:OrderedDict"})
    impostor = type("P2RConfig", (), {})  # same name, another module: not the registered class
    assert impostor not in mapping
    assert len(mapping._extra_content.pending) == 1  # nothing imported yet

    from hf_p2r import P2RConfig

    assert P2RConfig in mapping
    assert mapping[P2RConfig] is collections.OrderedDict
    assert not mapping._extra_content.pending
    defer_auto_registration(mapping, {config_path: "collections:Counter"})  # already resolved: kept
    assert mapping[P2RConfig] is collections.OrderedDict
    mapping.register(P2RConfig, collections.Counter, exist_ok=True)  # a later register replaces it
    assert mapping[P2RConfig] is collections.Counter and list(mapping._extra_content) == [P2RConfig]


def write_through_local_tensor(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    block = nn.Linear(4, 4)
    fully_shard(block, mesh=mesh)
    with torch.no_grad():
        local_tensor(block.weight).fill_(3.0)  # a view of the shard: the parameter sees the write
    plain = torch.ones(2)
    return {"shard": block.weight.to_local().tolist(), "plain_is_itself": local_tensor(plain) is plain}


def test_local_tensor_is_a_writable_view_of_the_shard(tmp_path):
    result = spawn.run(write_through_local_tensor, 1, tmp_path)
    assert result == {"shard": [[3.0] * 4] * 4, "plain_is_itself": True}


def test_tensor_version_counts_in_place_writes():
    tensor = torch.zeros(2)
    before = tensor_version(tensor)
    tensor.add_(1)
    tensor[0] = 5
    assert tensor_version(tensor) == before + 2


def test_accelerate_lists_prepared_models_and_forgets_a_preparation():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    prepared = accelerator.prepare(model)
    assert prepared_models(accelerator) == [prepared]
    assert getattr(prepared, "_is_accelerate_prepared", False)  # the mark `prepare` checks before wrapping again
    forget_preparation(prepared)
    assert not getattr(prepared, "_is_accelerate_prepared", False)
    accelerator.free_memory()
    assert prepared_models(accelerator) == []


def test_mark_auto_class_is_what_register_for_auto_class_sets_and_what_save_reads(tmp_path):
    """`custom_object_save` copies a class's code when the object carries `_auto_class`, as registering sets it."""
    from transformers.dynamic_module_utils import custom_object_save

    from hf_p2r import P2RConfig, P2RForCausalLM
    from hf_p2r.compat import mark_auto_class

    config = P2RConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    stand_in = P2RForCausalLM.__new__(P2RForCausalLM)
    mark_auto_class(stand_in, "AutoModelForCausalLM")
    mark_auto_class(config, "AutoConfig")
    custom_object_save(stand_in, tmp_path, config=config)
    assert config.auto_map["AutoModelForCausalLM"].endswith("modeling_p2r.P2RForCausalLM")
    assert (tmp_path / "modeling_p2r.py").is_file()
    assert getattr(P2RForCausalLM, "_auto_class", None) is None  # the class itself is left as it was
    config.save_pretrained(tmp_path)
    assert (tmp_path / "configuration_p2r.py").is_file()


def test_causal_lm_tp_plan_is_the_head_plan_transformers_assembles():
    from hf_p2r import P2RConfig, P2RForCausalLM
    from hf_p2r.compat import causal_lm_tp_plan

    config = P2RConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    model = P2RForCausalLM(config)
    plan = causal_lm_tp_plan(P2RForCausalLM)
    assert plan and plan.items() <= model.tp_plan.items()
    assert causal_lm_tp_plan(object) == {}


def test_output_collector_is_what_capture_outputs_records_into_and_compiled_code_appends_to_it():
    """`active_output_collector` is the dict a capturing forward records into (None outside one); inside
    `output_capture_for_compiled_code` transformers' hooks read the fresh collector (the `compiling` path), and what
    they append reaches the outer lists at the exit, unless `keep` is false."""
    from transformers.utils.output_capturing import _active_collector

    from hf_p2r.compat import active_output_collector, output_capture_for_compiled_code

    assert active_output_collector() is None
    outer = {"hidden_states": [torch.zeros(1)], "_hidden_states_layers": [0, 1]}
    token = _active_collector.context_var.set(outer)
    try:
        assert active_output_collector() is outer
        for keep in (True, False):
            with output_capture_for_compiled_code(active_output_collector(), keep=keep):
                inner = _active_collector.get()  # what a hook reads
                assert inner is not outer and inner == {"hidden_states": [], "_hidden_states_layers": [0, 1]}
                inner["hidden_states"].append(torch.ones(1))
            assert _active_collector.compiling is False and _active_collector.global_var is None
    finally:
        _active_collector.context_var.reset(token)
    assert [t.item() for t in outer["hidden_states"]] == [0.0, 1.0]


def test_forward_without_checkpointing_is_the_forward_the_layer_class_defines():
    from torch.distributed.fsdp import FSDPModule

    from hf_p2r.compat import forward_without_checkpointing
    from hf_p2r.models.p2r.modeling_p2r import P2RDecoderLayer

    defined = P2RDecoderLayer.__dict__["forward"]  # (transformers wraps it in place, at the class's creation)
    while defined.__code__.co_name != "forward":  # P2R's cache-name decorator stays: it is part of the forward
        defined = defined.__wrapped__
    fsdp_class = type("FSDPP2RDecoderLayer", (FSDPModule, P2RDecoderLayer), {})  # what fully_shard makes
    for layer_class in (P2RDecoderLayer, fsdp_class):
        assert layer_class.forward.__code__.co_name == "forward_with_checkpointing"
        forward = forward_without_checkpointing(layer_class)
        assert forward.__code__.co_name != "forward_with_checkpointing"
        assert inspect.unwrap(forward) is inspect.unwrap(defined)
    assert forward_without_checkpointing(nn.Linear) is nn.Linear.forward


def test_init_module_weights_is_the_models_own_init_of_one_module():
    """A Linear gets normal(0, initializer_range) from the global generator (the same draw as torch's `normal_` under
    the same seed), a residual projection P2R's depth-scaled std, a norm ones, the rotary tables their values again."""
    from hf_p2r.compat import init_module_weights

    from .conftest import tiny_model

    model = tiny_model()
    std = model.config.initializer_range
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.input_layernorm, model.model.rotary_emb):
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data.zero_()
    torch.manual_seed(5)
    init_module_weights(model, layer.self_attn.q_proj)
    expected = torch.empty_like(layer.self_attn.q_proj.weight)
    torch.manual_seed(5)
    torch.nn.init.normal_(expected, mean=0.0, std=std)
    assert torch.equal(layer.self_attn.q_proj.weight, expected)
    init_module_weights(model, layer.input_layernorm)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    init_module_weights(model, model.model.rotary_emb)
    fresh = tiny_model().model.rotary_emb
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.inv_freq) and model.model.rotary_emb.inv_freq.any()
    init_module_weights(model, layer.mlp.down_proj)
    scaled = std / (2 * model.config.num_hidden_layers) ** 0.5
    assert abs(layer.mlp.down_proj.weight.std().item() - scaled) < 0.2 * scaled


def test_dynamo_counters_count_compiled_graphs_and_graph_breaks():
    from hf_p2r.compat import dynamo_counters

    def broken(x):
        x = x + 1
        print("a graph break")
        return x * 2

    torch.compiler.reset()
    before = dynamo_counters()
    torch.compile(broken, backend="eager")(torch.ones(2))
    after = dynamo_counters()
    assert after["stats"]["unique_graphs"] - before.get("stats", {}).get("unique_graphs", 0) == 2
    assert sum(after["graph_break"].values()) > sum(before.get("graph_break", {}).values())


def test_pipeline_stage_backward_returns_the_inputs_gradients_and_accumulates_the_weights():
    """A middle stage (its outputs' gradients received) and a last stage (its loss, no gradient): the gradients of the
    stage's inputs come back, a parameter's accumulate into `.grad`."""
    weight = nn.Parameter(torch.tensor([2.0, 3.0]))
    hidden = torch.tensor([1.0, 5.0], requires_grad=True)
    (grad,) = pipeline_stage_backward((hidden * weight,), (torch.tensor([1.0, 10.0]),), [hidden])
    assert torch.equal(grad, torch.tensor([2.0, 30.0]))
    assert torch.equal(weight.grad, torch.tensor([1.0, 50.0]))
    hidden = torch.tensor([1.0, 1.0], requires_grad=True)
    (grad,) = pipeline_stage_backward((hidden * weight).sum(), None, [hidden])
    assert torch.equal(grad, torch.tensor([2.0, 3.0]))
    assert torch.equal(weight.grad, torch.tensor([2.0, 51.0]))


def read_stashed_graphs(rank: int, world_size: int) -> dict:
    """One stage under torch's GPipe (every forward, then every backward): the stash after each forward."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    stage = PipelineStage(block, 0, 1, torch.device("cpu"))
    seen, forward = [], stage.forward_one_chunk

    def observed(*args, **kwargs):
        output = forward(*args, **kwargs)
        nodes = pipeline_stage_stashed_graphs(stage)
        reached = {id(next_node) for node in nodes for next_node, _ in node.next_functions if next_node is not None}
        seen.append((len(nodes), all(isinstance(n, torch.autograd.graph.Node) for n in nodes), len(reached) > 0))
        return output

    stage.forward_one_chunk = observed
    ScheduleGPipe(stage, 2, loss_fn=lambda output, target: (output - target).pow(2).mean()).step(
        torch.randn(4, 4), target=torch.zeros(4, 4)
    )
    return {"seen": seen, "after": len(pipeline_stage_stashed_graphs(stage)), "grad": block.weight.grad is not None}


def test_pipeline_stage_stashed_graphs_follow_the_micro_batches_in_flight(tmp_path):
    """torch 2.11-2.13 keep a stage's forward outputs in `fwd_cache`, 2.15 in `_forward_chunk_states`: after each of
    GPipe's two forwards, one more autograd node per output, reaching the graph; none after the step's backwards."""
    result = spawn.run(read_stashed_graphs, 1, tmp_path)
    assert result == {"seen": [[1, True, True], [2, True, True]], "after": 0, "grad": True}


def test_initialize_pipeline_stage_calls_torchs_own_with_the_arguments_it_takes():
    """torch 2.11's `PipelineScheduleSingle._initialize_stage` takes (args, kwargs), later releases also the target (and
    optional loss_kwargs):
    the compat call matches the installed signature (a stand-in schedule with torch's own signature records it)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    signature = inspect.signature(PipelineScheduleSingle._initialize_stage)
    taken = list(signature.parameters.values())[1:]  # without self
    assert [p.name for p in taken[:3]] in (["args", "kwargs"], ["args", "kwargs", "target"])
    calls = []

    def record(*arguments):
        calls.append(arguments)

    record.__signature__ = signature.replace(parameters=taken)
    schedule = SimpleNamespace(_initialize_stage=record, _n_microbatches=2)
    initialize_pipeline_stage(schedule, 8, ("x",), {"k": 1}, "target")
    assert schedule._n_microbatches == 8
    assert calls == [(("x",), {"k": 1}, "target")[: min(len(taken), 3)]]


def test_dcp_reader_reads_what_torchs_reader_reads_and_refuses_other_globals(tmp_path):
    """A DCP checkpoint of a model, AdamW state, a MoE-like 3-D tensor and a counter: the reader's metadata equals
    torch's own reader's, and `dcp.load` through it loads the tensors. A `.metadata` pickle naming anything else
    (here `os.system`, which a crafted checkpoint would run under torch's `pickle.load`) is refused before the call."""
    import os
    import pickle

    import torch.distributed.checkpoint as dcp

    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": dict(model.state_dict()),
        "optimizer": {str(i): dict(s) for i, s in enumerate(optimizer.state.values())},
        "experts": torch.arange(24.0, dtype=torch.bfloat16).reshape(2, 3, 4),
        "counters": torch.tensor([3, 4]),
    }
    dcp.save(state, checkpoint_id=tmp_path / "ok", no_dist=True)
    ours = dcp_reader(tmp_path / "ok").read_metadata()
    theirs = dcp.FileSystemReader(tmp_path / "ok").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    loaded = {"experts": torch.zeros(2, 3, 4, dtype=torch.bfloat16), "counters": torch.zeros(2, dtype=torch.long)}
    dcp.load(loaded, storage_reader=dcp_reader(tmp_path / "ok"), no_dist=True)
    assert torch.equal(loaded["experts"], state["experts"]) and loaded["counters"].tolist() == [3, 4]

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match=r"^posix\.system is not part of a DCP checkpoint's metadata$"):
        dcp_reader(tmp_path / "bad").read_metadata()
    assert not (tmp_path / "ran").exists()
    # Pickled bytes (DCP loads them with torch.load(weights_only=False)): hf-p2r's checkpoints hold none.
    dcp.save({"note": "text"}, checkpoint_id=tmp_path / "bytes", no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match=r"BytesStorageMetadata is not part of"):
        dcp_reader(tmp_path / "bytes").read_metadata()
    # ... unless asked (to check the metadata of a folder another library loads): the records, never loaded through it
    metadata = dcp_reader(tmp_path / "bytes", bytes_entries=True).read_metadata()
    assert metadata.state_dict_metadata == dcp.FileSystemReader(tmp_path / "bytes").read_metadata().state_dict_metadata


def test_the_profiler_records_a_thread_started_before_it():
    """`profiler_config_all_threads`: a range on a worker thread that existed before the profiler started is in its
    trace (granular offload's updates run on one); without it the profiler records only its own thread's."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.profiler import ProfilerActivity, profile, record_function

    from hf_p2r.compat import profiler_config_all_threads

    def work():
        with record_function("worker.range"):
            torch.ones(4).add_(1)

    config = profiler_config_all_threads()
    if config is None:
        pytest.skip(f"torch {torch.__version__}'s profiler cannot record every thread")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: None).result()  # the thread exists before the profiler
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            pool.submit(work).result()
    names = {event.name for event in prof.events()}
    assert "worker.range" in names
