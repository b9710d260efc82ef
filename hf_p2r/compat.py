"""The one place hf-p2r reads what torch and the Hugging Face libraries keep private.

Each read is written for every release pyproject.toml allows; tests/test_compat.py runs them on the declared floors
and on the newest releases (.ci/run's compatibility pass), so a private name that moves breaks here, with a test,
instead of somewhere in a training run. No torch at import: the converter's fast path imports this module.

By library: huggingface_hub (`parse_size_to_int`), transformers (`defer_auto_registration`, `mark_auto_class`,
`causal_lm_tp_plan`, `active_output_collector`, `output_capture_for_compiled_code`,
`forward_without_checkpointing`, `init_module_weights`), torch.compile (`dynamo_counters`), Accelerate
(`prepared_models`, `forget_preparation`, `restore_forward`, `import_deepspeed_only_when_used`), torch autograd and
tensors (`in_backward`, `tensor_version`, `local_tensor`), the profiler (`profiler_config_all_threads`), FSDP2
(`reshard_after_backward`),
torch.distributed.pipelining (`pipeline_order`, `initialize_pipeline_stage`, `pipeline_stage_backward`),
torch.distributed.checkpoint (`dcp_reader`). A new read goes beside its library's, with a test.
"""

import functools
import importlib
import inspect
from collections.abc import Callable
from contextlib import contextmanager

__all__ = [
    "active_output_collector",
    "causal_lm_tp_plan",
    "dcp_reader",
    "defer_auto_registration",
    "dynamo_counters",
    "forward_without_checkpointing",
    "forget_preparation",
    "import_deepspeed_only_when_used",
    "in_backward",
    "init_module_weights",
    "initialize_pipeline_stage",
    "local_tensor",
    "mark_auto_class",
    "output_capture_for_compiled_code",
    "parse_size_to_int",
    "pipeline_order",
    "pipeline_stage_backward",
    "prepared_models",
    "reshard_after_backward",
    "restore_forward",
    "tensor_version",
    "zero3_copy_fp32_to_partitions",
    "zero3_full",
    "zero3_optimizer_states",
    "zero3_set_full",
    "zero3_start_optimizer_states",
]


def parse_size_to_int(size: int | str) -> int:
    """ "5GB" -> bytes, as `save_pretrained` reads `max_shard_size` (huggingface_hub's private parser)."""
    from huggingface_hub.serialization._base import parse_size_to_int as parse

    return parse(size)


def defer_auto_registration(mapping, entries: dict[str, str]) -> None:
    """Register classes with one of transformers' Auto mappings without importing them: each is imported on its
    first lookup, as transformers' own models are.

    `mapping` is `CONFIG_MAPPING` (keys: model types) or a model mapping such as `MODEL_FOR_CAUSAL_LM_MAPPING` (keys:
    config classes, named here "module:Class"); `entries` maps each key to the "module:Class" of its value. What
    `AutoConfig.register` / `AutoModel.register` would put into the mapping's `_extra_content` (the registry of
    classes from outside transformers) is put there as a name, resolved when transformers asks for it: when it is
    looking a model up, never while one of its own modules is still being imported (which is what registering with
    classes at import time cannot avoid: `import hf_p2r; from transformers import pipeline` once failed so).
    """
    extra = mapping._extra_content
    if not isinstance(extra, _DeferredEntries):
        extra = mapping._extra_content = _DeferredEntries(extra, by_class=any(":" in key for key in entries))
    extra.pending.update((key, value) for key, value in entries.items() if extra.find(key) is None)


def mark_auto_class(obj, auto_class: str) -> None:
    """Set the `_auto_class` that transformers' `register_for_auto_class` sets on a class, on `obj` alone (a config,
    or a stand-in instance of a model class): `custom_object_save` and `config.save_pretrained` then copy the defining
    modules and write `auto_map` for it, for this save only."""
    object.__setattr__(obj, "_auto_class", auto_class)


def causal_lm_tp_plan(model_class) -> dict[str, str]:
    """The tensor-parallel plan a causal LM class adds for its own modules (the head), before the base model's: the
    class attribute `_tp_plan` that transformers' `init_parallel_plans` reads ({} when it has none)."""
    return dict(getattr(model_class, "_tp_plan", None) or {})


def active_output_collector() -> dict | None:
    """What transformers' output capturing (`capture_outputs`: hidden states, attentions, MoE router logits) is
    recording now: {key: list of recorded tensors}, or None outside a capturing forward (`_active_collector`)."""
    from transformers.utils import output_capturing

    return output_capturing._active_collector.get()


@contextmanager
def output_capture_for_compiled_code(outer: dict | None, keep: bool = True):
    """Let transformers' output-capturing hooks run inside code that torch.compile traces while the model around it
    runs eagerly (a decoder block compiled alone), and keep what they record in `outer` (`active_output_collector()`
    read before).

    `capture_outputs` records through forward hooks that read the active collector from a `ContextVar`, which dynamo
    cannot trace (a graph break; an error under `fullgraph=True`). transformers' collector
    (`output_capturing._active_collector`, a `CompileableContextVar`) reads a plain attribute instead (`global_var`)
    when its `compiling` flag is set, as `set` does when the whole model is being compiled. Inside this context the
    flag is set and the attribute holds a fresh collector: `outer`'s keys, each record's list empty, so that the
    compiled code's guards see the same lengths at every call (`outer`'s lists grow by one entry per depth: guarding
    on their lengths would recompile at every depth). At the exit what the hooks appended is added to `outer`'s
    lists, in order, unless `keep` is false (an activation-checkpointed block recomputed in the backward records its
    outputs a second time), and the collector is put back as it was. A hook that reads what earlier calls recorded
    (transformers' hidden-states hook counts the entries) must sit outside the compiled code: the block's own hooks
    do, as `nn.Module.__call__` runs them around `forward`.
    """
    from transformers.utils import output_capturing

    collector = output_capturing._active_collector
    # The records are the lists under public keys ("_hidden_states_layers" is a selection of indices, not a record).
    recorded = [key for key, value in (outer or {}).items() if isinstance(value, list) and not key.startswith("_")]
    fresh = None if outer is None else {**outer, **{key: [] for key in recorded}}
    saved = collector.compiling, collector.global_var
    collector.compiling, collector.global_var = True, fresh
    try:
        yield
    finally:
        collector.compiling, collector.global_var = saved
    if keep:
        for key in recorded:
            outer[key].extend(fresh[key])


def forward_without_checkpointing(layer_class: type) -> Callable:
    """The `forward` a transformers `GradientCheckpointingLayer` subclass defines, without the activation-checkpointing
    wrappers that `GradientCheckpointingLayer.__init_subclass__` puts around it (one per subclass: FSDP2's
    `FSDP<Layer>` class adds a second). Other decorators stay. A class that is not such a layer: its `forward`."""
    forward = layer_class.forward
    while getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
        forward = forward.__wrapped__
    return forward


def init_module_weights(model, module) -> None:
    """Initialise `module` (a submodule of the transformers `model`, its own tensors only) as `post_init` does: the
    model's `_init_weights(module)` (private, and what every transformers model overrides), under no_grad, drawing
    from torch's global generator; it recomputes a rotary embedding's `inv_freq` tables from the config."""
    import torch

    with torch.no_grad():
        model._init_weights(module)


def dynamo_counters() -> dict[str, dict[str, int]]:
    """torch.compile's (dynamo's) event counters since the last `torch._dynamo.reset()` (or `counters.clear()`), as
    plain dicts: "stats" holds "unique_graphs" (graphs compiled) and "calls_captured"; "graph_break" {reason: count};
    "recompiles" and "frames" where present (`torch._dynamo.utils.counters`)."""
    from torch._dynamo.utils import counters

    return {name: dict(counter) for name, counter in counters.items()}


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _listing(method):
    """`dict`'s `method` for `_DeferredEntries`: a listing, so every pending entry is imported first."""

    @functools.wraps(method)
    def listing(self, *args):
        self._resolve_all()
        return method(self, *args)

    return listing


class _DeferredEntries(dict):
    """An Auto mapping's `_extra_content` whose `pending` entries ("module:Class" names) are imported on first use.

    Every dict read a mapping makes (`in`, `[]`, `get`, `keys`, `values`, `items`, iteration, `dict(...)`) sees the
    pending entries; a lookup imports the one it needs, a listing imports them all. Writing a key (a later
    `register` of the same name) replaces its pending entry.
    """

    def __init__(self, registered: dict, by_class: bool):
        super().__init__(registered)
        self.by_class = by_class
        self.pending: dict[str, str] = {}

    def find(self, key) -> str | None:
        """The pending name for `key` (a model type, or a class matched by module and name), if any."""
        if self.by_class and not isinstance(key, str):
            key = f"{getattr(key, '__module__', '')}:{getattr(key, '__qualname__', '')}"
        return key if isinstance(key, str) and key in self.pending else None

    def _resolve(self, name: str):
        value = _load(self.pending.pop(name))
        key = _load(name) if self.by_class else name
        dict.__setitem__(self, key, value)
        return value

    def _resolve_all(self) -> None:
        for name in list(self.pending):
            self._resolve(name)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self.find(key) is not None

    def __getitem__(self, key):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        name = self.find(key)
        if name is None:
            raise KeyError(key)
        return self._resolve(name)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, value) -> None:
        name = self.find(key)
        if name is not None:
            del self.pending[name]
        dict.__setitem__(self, key, value)

    def __len__(self) -> int:
        return dict.__len__(self) + len(self.pending)

    keys = _listing(dict.keys)
    values = _listing(dict.values)
    items = _listing(dict.items)
    __iter__ = _listing(dict.__iter__)

    def copy(self) -> dict:
        self._resolve_all()
        return dict(dict.items(self))


def prepared_models(accelerator) -> list:
    """The models `accelerator.prepare` returned and still holds (what `save_state` saves): a DeepSpeed engine, DDP,
    or the model itself when prepared in place (one device, FSDP2). Accelerate keeps them in `_models`."""
    return list(accelerator._models)


def import_deepspeed_only_when_used() -> None:
    """Make Accelerate's model unwrapping (`Accelerator.unwrap_model`, `extract_model_from_parallel`) import DeepSpeed
    only where DeepSpeed is already imported (idempotent).

    It imports DeepSpeed whenever DeepSpeed is installed, to test whether a model is its engine, and DeepSpeed's
    import prints "Setting accelerator to CPU" (and more) into a run that does not use it. A model can only be a
    DeepSpeed engine once DeepSpeed has been imported (Accelerate imports it to make one), so the test is skipped
    before: Accelerate reads its `is_deepspeed_available` from `accelerate.utils.other`'s namespace there."""
    import sys

    from accelerate.utils import other

    available = other.is_deepspeed_available
    if getattr(available, "only_when_imported", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and available()

    is_deepspeed_available.only_when_imported = True
    other.is_deepspeed_available = is_deepspeed_available


def forget_preparation(model) -> None:
    """Drop Accelerate's "already prepared" mark from `model` (`_is_accelerate_prepared`), so that the next `prepare`
    wraps it again (mixed precision's autocast forward included) instead of handing it back as it is."""
    vars(model).pop("_is_accelerate_prepared", None)


def restore_forward(model) -> None:
    """Put back the forward that Accelerate's mixed precision wrapped in autocast (`_original_forward`): the class's,
    or one patched on the instance (TRL's fused LM head). `unwrap_model(keep_fp32_wrapper=False)` instead follows the
    `__wrapped__` chain to its innermost function, past the model's own decorators (`can_return_tuple`) and past such
    a patch."""
    original = vars(model).pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is model and original.__func__ is type(model).forward:
        vars(model).pop("forward", None)  # the class's: no instance attribute
    else:
        model.forward = original


def local_tensor(tensor):
    """This rank's shard of a DTensor (`_local_tensor`: a view, so writes go to the shard; `to_local()` is an autograd
    function), or the tensor itself."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def tensor_version(tensor) -> int:
    """The tensor's version counter (`_version`), which every in-place write increments: how a copy knows whether its
    source changed since it was taken."""
    return tensor._version


def profiler_config_all_threads():
    """A `torch.profiler.profile(experimental_config=...)` that records every thread's operators and ranges (those of
    threads started before the profiler too: granular offload's worker), or None where this torch's
    `_ExperimentalConfig` has no `profile_all_threads`."""
    from torch.profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def reshard_after_backward(module) -> bool:
    """FSDP2's `reshard_after_backward` of an FSDP2 unit: what `set_reshard_after_backward` last set (default True).

    FSDP2 has a setter and no getter. torch 2.12 turned the unit's one parameter group (`_fsdp_param_group`) into a
    list (`_fsdp_param_groups`); 2.11 has only the former.
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    if not groups:
        return True  # a unit that manages no parameters: nothing to reshard
    return all(group.reshard_after_backward for group in groups)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (e.g. an activation-checkpointed block being recomputed)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def pipeline_order(schedule: str, stages: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """torch.distributed.pipelining's own compute actions of `schedule` (a `get_schedule_class` name: "GPipe",
    "1F1B", "Interleaved1F1B", ...) for `stages` ranks, as (kind, stage, micro-batch) per rank, in the order each
    rank runs them; REDUCE_GRAD and idle steps left out.

    The schedule classes expose their order as `pipeline_order` (a list of `_Action`) only once built on a stage;
    `_schedule_visualizer.get_schedule_ops` builds them on a mocked `PipelineStage` (no process group needed).
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return [
        [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in rank
            if a is not None and a.microbatch_index is not None and a.is_compute_op
        ]
        for rank in get_schedule_ops(schedule, stages, microbatches)
    ]


def initialize_pipeline_stage(schedule, slots: int, args, kwargs, target) -> None:
    """Set up the stage of a `PipelineScheduleSingle` subclass for `slots` micro-batch slots (P2P warm-up, shape
    inference, receive buffers): torch's own `_initialize_stage`, which sizes the buffers by the schedule's private
    `_n_microbatches` (PipeDream-2BW keeps micro-batches in flight across steps in 2m slots). torch 2.11 takes
    (args, kwargs); later releases also the target."""
    schedule._n_microbatches = slots
    if len(inspect.signature(schedule._initialize_stage).parameters) >= 3:
        schedule._initialize_stage(args, kwargs, target)
    else:
        schedule._initialize_stage(args, kwargs)


def pipeline_stage_backward(stage_output, output_grads, input_values) -> tuple:
    """One micro-batch's whole backward through a pipeline stage, as torch's `PipelineStage` runs it (autograd from
    the stage's outputs and their gradients; the gradients of the stage's inputs returned): torch's private
    `torch.distributed.pipelining._backward.stage_backward`, the same signature from torch 2.11 to 2.15."""
    from torch.distributed.pipelining._backward import stage_backward

    return stage_backward(stage_output, output_grads, input_values)


def pipeline_stage_stashed_graphs(stage) -> list:
    """The autograd nodes (`grad_fn`s) of the outputs a pipeline stage keeps for the backward of each micro-batch it
    ran forward and not yet backward: torch's private stash, `fwd_cache` {chunk: (outputs, inputs)} up to torch 2.13,
    `_forward_chunk_states` {chunk: state} from 2.15 (an output already sent may be dropped there, its gradient edge
    kept: the edge's node is the same grad_fn)."""
    import torch

    nodes = []
    if hasattr(stage, "fwd_cache"):
        for outputs, _ in stage.fwd_cache.values():
            nodes += [t.grad_fn for t in outputs if torch.is_tensor(t) and t.grad_fn is not None]
        return nodes
    for state in stage._forward_chunk_states.values():
        for live, edge in zip(state.live_outputs, state.output_grad_edges, strict=True):
            if torch.is_tensor(live) and live.grad_fn is not None:
                nodes.append(live.grad_fn)
            elif edge is not None:
                nodes.append(edge.node)
    return nodes


# What a DCP checkpoint's `.metadata` pickle may name: DCP's own metadata records, torch.Size, dtypes and layouts, and
# the path it was saved to. Anything else (os.system, builtins.eval, ...) is refused before it is called. Not
# BytesStorageMetadata: hf-p2r's checkpoints hold tensors only, and DCP loads a "bytes" entry with
# torch.load(weights_only=False), which a crafted checkpoint could declare for any key.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # Python 3.13+
    "collections": {"OrderedDict"},
}


def dcp_reader(path, *, bytes_entries: bool = False):
    """torch.distributed.checkpoint's `FileSystemReader` for `path` whose `.metadata` (a pickle, which torch's reader
    loads with `pickle.load`: any code a crafted file names would run) is unpickled naming only DCP's metadata records,
    torch.Size, dtypes, layouts and paths; anything else is `pickle.UnpicklingError` before it is called. The shards'
    tensors torch reads itself, with `torch.load(weights_only=True)`; an entry of pickled bytes (which DCP would load
    with `weights_only=False`) is refused with the rest, unless `bytes_entries` (to check the metadata of a folder
    another library loads, such as Accelerate's FSDP optimizer state, whose bytes entries are then checked one by one:
    never load through such a reader). Reads the reader's private `_get_metadata_path`, `fs` and `load_id` (the same in
    torch 2.11 and 2.15) to do what its `read_metadata` does."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            allowed = (
                name in _DCP_METADATA_GLOBALS.get(module, ())
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
                or (
                    bytes_entries
                    and (module, name) == ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
                )
            )
            if not allowed:
                raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")
            return super().find_class(module, name)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
                metadata = MetadataUnpickler(file).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def zero3_optimizer_states(optimizer, param) -> dict:
    """The state (a dict, possibly empty) that the torch optimizer inside DeepSpeed's ZeRO-3 optimizer keeps for the
    flat fp32 partition holding `param` (its sub-group's: `grad_position`, `fp32_partitioned_groups_flat`). DeepSpeed's
    public `safe_get_full_optimizer_state` reads a key's values, not which keys there are or the shared `step`."""
    group = optimizer.grad_position[optimizer.get_param_id(param)][0]
    return optimizer.optimizer.state[optimizer.fp32_partitioned_groups_flat[group]]


def zero3_start_optimizer_states(optimizer, keys: list[str]) -> None:
    """Give every flat fp32 partition of DeepSpeed's ZeRO-3 `optimizer` the state `keys` (zeros like the partition)
    and a `step` of 0 where it has none yet: torch's optimizers create their state at the first step, and
    `zero3_set_full` writes into a state that exists (DeepSpeed's universal-checkpoint load assigns them so too)."""
    import torch

    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(flat)
        state.setdefault("step", torch.tensor(0.0))


def zero3_copy_fp32_to_partitions(optimizer) -> None:
    """After `zero3_set_full` wrote DeepSpeed ZeRO-3's fp32 master partitions: copy them into the model's
    own (16-bit or fp32) partitions, which the forward gathers, as DeepSpeed's universal-checkpoint load does
    (`fp16_partitioned_groups_flat`, `unflatten` into `fp16_partitioned_groups`)."""
    for flat, low in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat, strict=True):
        if flat.numel() > 0:
            low.data.copy_(flat.data)
    for group, flat in enumerate(optimizer.fp16_partitioned_groups_flat):
        partitions = optimizer.fp16_partitioned_groups[group]
        for partition, values in zip(partitions, optimizer.unflatten(flat, partitions), strict=True):
            partition.data = values.data


def zero3_set_full(optimizer, param, value, key: str | None = None) -> None:
    """Write this process's partition of `param`'s fp32 master weights (`key` None) or of its optimizer state `key`
    in DeepSpeed's ZeRO-3 `optimizer` from `value`, the whole tensor (on every process). DeepSpeed's
    `safe_set_full_fp32_param` / `safe_set_full_optimizer_state` narrow `value` to the padded partition size, which
    runs past its end on the last process when the size does not divide the tensor; here the padding is zeroed, as
    DeepSpeed pads a partition."""
    import torch.distributed as dist

    partition, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    if hasattr(optimizer, "_get_param_partition_rank"):  # DeepSpeed 0.19.8 (per-parameter partition groups)
        rank = optimizer._get_param_partition_rank(param)
    else:  # 0.19.0: every parameter partitioned over the data-parallel group
        rank = dist.get_rank(group=optimizer.dp_process_group)
    start = partition.numel() * rank
    real = max(0, min(partition.numel(), param.ds_numel - start))
    flat = value.reshape(-1)
    partition.narrow(0, 0, real).copy_(flat.narrow(0, start, real))
    partition.narrow(0, real, partition.numel() - real).zero_()


def zero3_full(param):
    """The whole value of a DeepSpeed ZeRO-3 parameter, gathered from every process's partition (`ds_tensor`, over its
    `ds_process_group`; a collective): what `deepspeed.zero.GatheredParameters` gives, except for a parameter this
    process already holds whole or is gathering (the small ones ZeRO-3 keeps whole, `ds_persist`; status AVAILABLE or
    INFLIGHT), which GatheredParameters leaves as it is: on DeepSpeed 0.19.0 with two CPU processes such a copy was
    seen to read wrong, timing-dependently (a norm's weight, at build and after a step)."""
    import deepspeed.comm as ds_dist
    import torch

    part = param.ds_tensor.detach().reshape(-1)
    pieces = [torch.empty_like(part) for _ in range(ds_dist.get_world_size(group=param.ds_process_group))]
    ds_dist.all_gather(pieces, part.contiguous(), group=param.ds_process_group)
    return torch.cat(pieces).narrow(0, 0, param.ds_numel).view(param.ds_shape)
