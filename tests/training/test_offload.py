"""Granular CPU offload: layer selection, hook install/removal, and training that equals training without offload.

Without CUDA the storage and compute device are both the CPU: the working copies are CPU tensors whose storage is
allocated only while their block is fetched, so the schedule (fetch, release, re-fetch for backward and
recomputation), the gradient hooks and the CPU optimizer all run as on a GPU. GPU-only tests are at the end.
"""

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

from benchmarks import presets
from hf_p2r.compat import tensor_version
from hf_p2r.distributed.offload import (
    GranularOffload,
    decoder_layers,
    estimate_device_bytes,
    estimate_host_bytes,
    measure_activation_bytes,
    offload_working_set_bytes,
    select_layers,
    spread_layers,
)

from ..conftest import requires_cuda, tiny_model
from .helpers import LastMicroBatch, token_batches

PSEUDO = dict(share_layers=True, num_unique_layers=2)


def _assert_trained_alike(offloaded, plain, steps=3, lr=None):
    """Each (model, optimizer) pair through the same `steps` batches, an optimizer step each (at learning rate `lr`
    set before each, as the trainer's schedule does, where given); then their parameters are equal, bit for bit."""
    from hf_p2r.training.optim import set_learning_rate

    for model, optimizer in (offloaded, plain):
        for batch in token_batches(steps):
            if lr is not None:
                set_learning_rate(optimizer, lr)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(offloaded[0].named_parameters(), plain[0].parameters()):
        assert torch.equal(p, q), name


def _train(
    model,
    offload=None,
    *,
    steps=3,
    accumulation=1,
    checkpointing=None,
    device="cpu",
    first_grads=None,
    host_optimizer=None,
    offload_clip=False,
    **offload_kwargs,
):
    """AdamW (weight decay, clipping that bites) for `steps` optimizer steps; returns {name: parameter}.

    `first_grads`: a dict to fill with {name: gradient} of the first optimizer step, before clipping. `host_optimizer`:
    options of another AdamW for the offloaded parameters (the resident ones keep fused AdamW). `offload_clip`: clip
    with `GranularOffload.clip_grad_norm_` instead of torch's."""
    model.train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    hyper = dict(lr=1e-2, weight_decay=0.1, fused=True)
    if offload is None:
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), **hyper)
    else:
        offload = GranularOffload(model, offload, device=device, **offload_kwargs)
        optimizer = offload.build_optimizer(**hyper)
        if host_optimizer is not None:
            host = {id(p) for p in offload.offloaded_parameters}
            resident = [p for p in model.parameters() if id(p) not in host]
            optimizer = _Both(
                torch.optim.AdamW(resident, **hyper),
                torch.optim.AdamW(offload.offloaded_parameters, **{**hyper, **host_optimizer}),
            )
    for i, batch in enumerate(token_batches(steps * accumulation), 1):
        batch = batch.to(device)
        model(input_ids=batch, labels=batch).loss.backward()
        if i % accumulation == 0:
            if first_grads is not None and i == accumulation:
                first_grads.update({name: p.grad.to("cpu", copy=True) for name, p in model.named_parameters()})
            clip = offload.clip_grad_norm_ if offload_clip else torch.nn.utils.clip_grad_norm_
            clip(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
    if offload is not None:
        offload.synchronize()  # `overlap_step`: the last step's offloaded blocks may still be stepping
    params = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    return params, offload


class _Both:
    """Two optimizers stepped as one."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def _output_tensor(output) -> torch.Tensor:
    """A block's hidden states output (a tensor, or the first element of a tuple)."""
    return output if isinstance(output, torch.Tensor) else output[0]


def _block_bytes(model, index=0):
    return sum(p.numel() * p.element_size() for p in decoder_layers(model)[index].parameters())


# ----------------------------------------------------------------------------------------------------- selection


def test_select_indices_and_ratios_real_model():
    model = tiny_model()  # 8 blocks
    assert select_layers(model, None) == []
    assert select_layers(model, [5, 1, 5]) == [1, 5]
    assert select_layers(model, 0.0) == []
    assert select_layers(model, 0.25) == [3, 7]
    assert select_layers(model, 0.5) == [1, 3, 5, 7]
    assert select_layers(model, 1.0) == list(range(8))
    assert spread_layers(3, 8) == [2, 5, 7]


def test_select_counts_shared_blocks_once():
    pseudo = tiny_model(**PSEUDO)  # 8 depths, 2 blocks
    assert pseudo.config.block_of_depth == [0, 1] * 4
    assert select_layers(pseudo, 0.5) == [1]  # half of the blocks, not of the depths
    assert select_layers(pseudo, 1.0) == [0, 1]
    assert select_layers(pseudo, [0]) == [0]
    with pytest.raises(ValueError, match=r"\[2\] out of range: the model has blocks 0..1 .* a ratio .* or 'auto'"):
        select_layers(pseudo, [2])


@pytest.mark.parametrize("spec", ["all", 1, 1.5, -0.1, [0, "1"], True, {"layers": [0]}])
def test_select_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="offload"):
        select_layers(tiny_model(), spec)


@pytest.mark.parametrize("overrides", [{}, PSEUDO])
def test_auto_offloads_the_fewest_blocks_that_fit(overrides):
    model = tiny_model(**overrides)
    blocks = decoder_layers(model)
    n = len(blocks)
    # Expected bytes from the tensors themselves: fp32 param + grad + 2 AdamW moments = 4x parameter bytes.
    block = _block_bytes(model)
    others = sum(p.numel() * 4 for name, p in model.named_parameters() if ".layers." not in name)
    activations = 12345
    assert estimate_device_bytes(model, [], activation_bytes=activations) == 4 * (others + n * block) + activations
    # One block offloaded: its state leaves; its working set (itself + one block of gradients) stays.
    one = 4 * (others + (n - 1) * block) + 2 * block + activations
    assert estimate_device_bytes(model, [n - 1], activation_bytes=activations) == one

    def auto(budget):
        return select_layers(model, "auto", budget_bytes=budget, activation_bytes=activations)

    assert auto(4 * (others + n * block) + activations) == []
    assert auto(one) == [n - 1]
    assert auto(one - 1) == spread_layers(2, n)
    everything = estimate_device_bytes(model, range(n), activation_bytes=activations)
    assert auto(everything) == list(range(n))
    with pytest.raises(ValueError, match="even with all .* blocks offloaded"):
        auto(everything - 1)
    with pytest.raises(ValueError, match="needs budget_bytes"):
        select_layers(model, "auto")


def test_measure_activation_bytes_scales_with_the_batch_and_equals_pseudo_and_real():
    pseudo = tiny_model(**PSEUDO).train()
    real = copy.deepcopy(pseudo).delink()
    small, large = (torch.randint(3, 101, (b, 16), generator=torch.Generator().manual_seed(0)) for b in (2, 4))
    measured = measure_activation_bytes(pseudo, small)
    # Same depth and shapes: a pseudo model holds exactly the activations of its real model. (Every Linear saves its
    # weight, so counting parameters would give the real model, with 4x the block weights, more.)
    assert measured > 0 and measured == measure_activation_bytes(real, small)
    assert 1.8 < measure_activation_bytes(pseudo, large) / measured <= 2.0


# ---------------------------------------------------------------------------------------------- install / remove


def _hooks(model):
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return modules + params


def test_remove_restores_the_model():
    model = tiny_model(**PSEUDO)
    before = {name: (p, p.data_ptr(), p.device, p.detach().clone()) for name, p in model.named_parameters()}
    assert _hooks(model) == 0
    offload = GranularOffload(model, [1])
    offloaded = {id(p) for p in offload.offloaded_parameters}
    assert offloaded and _hooks(model) > 0
    model.train()
    batch = token_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    offload.remove()
    assert _hooks(model) == 0
    for name, p in model.named_parameters():
        original, data_ptr, device, value = before[name]
        assert p is original and p.device == device and p.dtype == value.dtype and p.stride() == value.stride()
        if id(p) in offloaded:  # copied out of the block's host allocation into memory of its own
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        else:
            assert p.data_ptr() == data_ptr
        assert torch.equal(p, value)  # no optimizer step ran
        assert p.grad is not None and p.grad.device == device
    # And it trains on as a plain model.
    model(input_ids=batch, labels=batch).loss.backward()


def test_each_block_lives_in_one_host_allocation_and_saves_like_a_plain_model(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model(**PSEUDO).train()
    reference = copy.deepcopy(model)
    offload = GranularOffload(model, [0, 1], compute_dtype=torch.bfloat16)
    for block in offload._blocks.values():
        slab = block.slab.untyped_storage()
        start, end = slab.data_ptr(), slab.data_ptr() + slab.nbytes()
        tensors = block.masters + [s for s in block.sources if s.dtype == torch.bfloat16] + block.staging
        assert len(tensors) == 3 * len(block.params)  # masters, bf16 copies to send, gradient landing buffers
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        assert all(start <= a and b <= end for a, b in spans)
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # disjoint
    # Each parameter has a storage of its own: safetensors (and Accelerate's save_state, which drops tensors that
    # share a storage) save every tensor.
    state = model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == state.keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    # The host estimate is what was allocated (unpinned here: no rounding), plus the gradients and AdamW state.
    optimizer = offload.build_optimizer(lr=1e-2)
    batch = token_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    params = offload.offloaded_parameters
    state_bytes = sum(t.numel() * t.element_size() for p in params for t in (optimizer.state[p]["exp_avg"], p.grad))
    state_bytes += sum(optimizer.state[p]["exp_avg_sq"].numel() * p.element_size() for p in params)
    allocated = sum(b.slab.numel() for b in offload._blocks.values())
    assert estimate_host_bytes(model, [0, 1], compute_dtype=torch.bfloat16, pinned=False) == allocated + state_bytes
    # Pinned, each block's allocation is rounded up to a power of two.
    pinned = estimate_host_bytes(model, [0, 1], compute_dtype=torch.bfloat16)
    rounded = sum(1 << (b.slab.numel() - 1).bit_length() for b in offload._blocks.values())
    assert pinned == rounded + state_bytes > allocated + state_bytes


def test_weights_are_on_the_device_only_while_their_block_runs():
    model = tiny_model().train()  # real: 8 blocks, all offloaded, prefetch 1
    offload = GranularOffload(model, 1.0, prefetch=1)
    blocks = offload._blocks
    masters = {id(p): m for b in blocks.values() for p, m in zip(b.params, b.masters)}
    seen = []

    def probe(index, module, args):
        params = list(module.parameters())
        # The block runs on device tensors holding the master values, not on the masters themselves.
        assert all(p.data_ptr() != masters[id(p)].data_ptr() for p in params)
        assert all(torch.equal(p, masters[id(p)]) for p in params)
        fetched = sorted(i for i, b in blocks.items() if b.fetched)
        seen.append((index, fetched))

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda module, args, i=i: probe(i, module, args))
    batch = token_batches(1)[0]
    loss = model(input_ids=batch, labels=batch).loss
    # Forward: at depth d only blocks d and d+1 (prefetch) hold memory.
    assert seen == [(d, [d, d + 1] if d < 7 else [7]) for d in range(8)]
    # Between forward and backward only the block backward needs first keeps its memory.
    assert [i for i, b in blocks.items() if b.fetched] == [7]
    assert all(w.untyped_storage().size() == 0 for i, b in blocks.items() if i != 7 for w in b.works)
    loss.backward()
    for b in blocks.values():
        assert not b.fetched and all(w.untyped_storage().size() == 0 for w in b.works)
        for p, master in zip(b.params, b.masters):
            assert p.data_ptr() == master.data_ptr() and p.grad is not None and p.grad.device.type == "cpu"
    # 8 blocks copied in forward, 7 again in backward (block 7 stays); every gradient copied out once.
    assert offload.copied_bytes == {"to_device": 15 * _block_bytes(model), "to_host": 8 * _block_bytes(model)}


@pytest.mark.parametrize("prefetch", [0, 1, 2, 9])
@pytest.mark.parametrize("checkpointing", [None, True], ids=["plain", "reentrant"])
def test_weights_in_flight_match_the_shared_working_set_estimate(prefetch, checkpointing):
    """The most device weight bytes allocated at once over a training step, measured on the working tensors, is the
    weight part of `offload_working_set_bytes`, which `estimate_device_bytes` and the planner use."""
    model = tiny_model().train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    offload = GranularOffload(model, 1.0, prefetch=prefetch)
    works = [w for b in offload._blocks.values() for w in b.works]
    peak = 0

    def measure(*args):
        nonlocal peak
        peak = max(peak, sum(w.untyped_storage().nbytes() for w in works))

    def backward_starts(module, args, output):
        _output_tensor(output).register_hook(measure)

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(measure)
        layer.register_forward_hook(backward_starts)
    batch = token_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    block = _block_bytes(model)
    assert peak == offload_working_set_bytes(block, 0, offloaded=8, prefetch=prefetch) == min(prefetch + 1, 8) * block
    # Gradients: two blocks at most, and one more per offloaded block run at several depths (autograd sums it).
    assert offload_working_set_bytes(0, block, offloaded=8) == 2 * block
    assert offload_working_set_bytes(0, block, offloaded=3, shared=2) == 3 * block
    assert offload_working_set_bytes(block, block, offloaded=0) == 0
    n = len(decoder_layers(model))
    others = estimate_device_bytes(model, [])
    assert estimate_device_bytes(model, range(n), prefetch=prefetch) == others - 4 * n * block + (
        offload_working_set_bytes(block, block, offloaded=n, prefetch=prefetch)
    )


CHECKPOINTING = {
    "plain": None,
    "checkpoint": ("model", False),  # transformers' checkpointing: the block's hooks run outside the checkpoint
    "reentrant": ("model", True),
    "wrapper": ("wrapper", False),  # checkpoint_wrapper applied after offload: recomputation calls the block
    "wrapper-reentrant": ("wrapper", True),
}


@pytest.mark.parametrize("mode", CHECKPOINTING)
def test_backward_prefetch_has_the_next_block_ready(mode, monkeypatch):
    """When block k's backward (or its recomputation) starts, block k-1, the next in backward order, has been
    fetched already, and each step copies every block once in forward and once in backward (the last block stays)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = tiny_model().train()  # 8 blocks, all offloaded, prefetch 1
    how = CHECKPOINTING[mode]
    if how is not None and how[0] == "model":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": how[1]})
    offload = GranularOffload(model, 1.0, prefetch=1)
    layers = list(decoder_layers(model))
    if how is not None and how[0] == "wrapper":
        impl = CheckpointImpl.REENTRANT if how[1] else CheckpointImpl.NO_REENTRANT
        model.model.layers = nn.ModuleList(checkpoint_wrapper(layer, checkpoint_impl=impl) for layer in layers)
    blocks = offload._blocks
    copies, starts = [], []
    fetch = offload._fetch

    def spy(block):
        if not block.fetched:
            copies.append(block.index)
        fetch(block)

    monkeypatch.setattr(offload, "_fetch", spy)

    def started(index, *args):  # registered after the offload's hooks: sees what they did
        if torch._C._current_graph_task_id() != -1:
            starts.append((index, {i for i, b in blocks.items() if b.fetched}))

    def output_hook(index, module, args, output):
        if _output_tensor(output).requires_grad:  # not in a reentrant checkpoint's forward
            _output_tensor(output).register_hook(lambda grad: started(index))

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: started(i))  # recomputation through the block
        layer.register_forward_hook(lambda module, args, output, i=i: output_hook(i, module, args, output))
    optimizer = offload.build_optimizer(lr=1e-2)
    for batch in token_batches(2):
        copies.clear()
        starts.clear()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert copies == list(range(8)) + list(range(6, -1, -1))
        assert {index for index, _ in starts} == set(range(8))
        for index, fetched in starts:
            assert index in fetched and (index == 0 or index - 1 in fetched), (index, fetched)


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_shared_block_is_copied_once_and_its_gradient_moves_once_per_backward(checkpointing):
    model = tiny_model(share_layers=True, num_unique_layers=1).train()  # one block at 8 depths
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    offload = GranularOffload(model, [0])
    for batch in token_batches(2):
        model(input_ids=batch, labels=batch).loss.backward()
    block = _block_bytes(model)
    # The block stays fetched through all 16 forward/backward positions: one copy in per step.
    assert offload.copied_bytes["to_device"] == 2 * block
    # Non-reentrant autograd sums the 8 uses first: one gradient per backward. A reentrant checkpoint runs one inner
    # backward per depth, each of which accumulates (and so moves) its part.
    assert offload.copied_bytes["to_host"] == 2 * block * (8 if checkpointing else 1)


def test_no_grad_forward_and_exceptions_close_the_window():
    model = tiny_model()
    reference = copy.deepcopy(model)
    offload = GranularOffload(model, 0.5)
    batch = token_batches(1)[0]
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    assert torch.equal(logits, reference(input_ids=batch).logits)
    masters = [(p, m) for b in offload._blocks.values() for p, m in zip(b.params, b.masters)]
    assert all(p.data_ptr() == m.data_ptr() for p, m in masters)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=None)
    assert all(p.data_ptr() == m.data_ptr() for p, m in masters)
    # A forward with grad enabled and no backward is closed by the next forward.
    model(input_ids=batch)
    assert not all(p.data_ptr() == m.data_ptr() for p, m in masters)
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch).logits, logits)
    assert all(p.data_ptr() == m.data_ptr() for p, m in masters)


def test_a_second_backward_through_one_forward_is_an_error():
    model = tiny_model().train()
    GranularOffload(model, [3])
    batch = token_batches(1)[0]
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran after its forward's window closed"):
        loss.backward()


def test_moving_the_model_while_applied_is_an_error():
    model = tiny_model()
    GranularOffload(model, [3])
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"call offload.remove\(\) first"):
        model(input_ids=token_batches(1)[0])


def test_distributed_wrappers_are_refused(monkeypatch, tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="does not compose with DistributedDataParallel"):
            GranularOffload(nn.parallel.DistributedDataParallel(tiny_model()), 0.5)
        sharded = tiny_model()
        fully_shard(sharded)
        with pytest.raises(ValueError, match="does not compose with FSDP"):
            GranularOffload(sharded, 0.5)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(ValueError, match="runs in a single process"):
            GranularOffload(tiny_model(), 0.5)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "checkpoint", "reentrant"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_training_with_offload_equals_training_without(overrides, checkpointing, accumulation):
    expected, _ = _train(tiny_model(**overrides), accumulation=accumulation, checkpointing=checkpointing)
    got, offload = _train(tiny_model(**overrides), 0.5, accumulation=accumulation, checkpointing=checkpointing)
    assert offload.layers and offload.copied_bytes["to_host"] > 0  # offload really ran
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # Control: the comparison sees a difference of one optimizer step.
    fewer, _ = _train(tiny_model(**overrides), 0.5, steps=2, accumulation=accumulation, checkpointing=checkpointing)
    assert not all(torch.equal(fewer[name], value) for name, value in expected.items())


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_through_the_block_call_fetches_the_block(reentrant):
    """torch's checkpoint_wrapper recomputes by calling the block itself, so its offload hooks run in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    results = []
    for spec in (None, 1.0):
        model = tiny_model(**PSEUDO).train()
        offload = GranularOffload(model, spec) if spec is not None else None
        model.model.layers = nn.ModuleList(
            checkpoint_wrapper(layer, checkpoint_impl=impl) for layer in model.model.layers
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for batch in token_batches(2):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert offload.copied_bytes["to_host"] > 0
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_optimizer_splits_groups_and_equals_one_plain_adamw():
    model = tiny_model().train()
    reference = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-3},
        ]

    offload = GranularOffload(model, [0, 5])
    optimizer = offload.build_optimizer(groups(model), lr=1e-2)
    plain = torch.optim.AdamW(groups(reference), lr=1e-2, fused=True)
    offloaded = {id(p) for p in offload.offloaded_parameters}
    # Resident parts first (their device kernels launch before the CPU part), options kept.
    kinds = [(all(id(p) in offloaded for p in g["params"]), g["weight_decay"], g["lr"]) for g in optimizer.param_groups]
    assert kinds == [(False, 0.1, 1e-2), (False, 0.0, 5e-3), (True, 0.1, 1e-2), (True, 0.0, 5e-3)]
    assert optimizer.defaults["fused"] is True
    _assert_trained_alike((model, optimizer), (reference, plain))
    # State per parameter, on the parameter's device; a state_dict round trip into a new optimizer continues exactly.
    assert all(optimizer.state[p]["exp_avg"].device == p.device for p in model.parameters())
    resumed = offload.build_optimizer(groups(model), lr=1e-2)
    resumed.load_state_dict(optimizer.state_dict())
    for p in model.parameters():
        assert torch.equal(resumed.state[p]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])


def test_delink_then_offload_continues_like_delink_alone():
    """The M6-10T combination as the trainer wires it: train the pseudo model, delink, offload the real model,
    rebuild the optimizer carrying each parameter's state, train on."""

    def run(spec):
        model = tiny_model(**PSEUDO).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        batches = token_batches(4)
        for batch in batches[:2]:
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        old = dict(model.named_parameters())
        mapping = model.delink_parameter_map()
        model.delink()
        offload = GranularOffload(model, spec) if spec is not None else None
        new = (
            offload.build_optimizer(lr=1e-2) if offload else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        )
        for name, p in model.named_parameters():
            new.state[p] = {k: v.clone() for k, v in optimizer.state[old[mapping[name]]].items()}
        new.load_state_dict(new.state_dict())  # places each state on its parameter's device
        for batch in batches[2:]:
            model(input_ids=batch, labels=batch).loss.backward()
            new.step()
            new.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(None), run(0.5)))


def test_compute_dtype_runs_blocks_in_bf16_and_keeps_fp32_masters():
    model = tiny_model().train()
    reference = copy.deepcopy(model)
    offload = GranularOffload(model, 1.0, compute_dtype=torch.bfloat16)
    masters = {id(p): m for b in offload._blocks.values() for p, m in zip(b.params, b.masters)}
    seen = []  # per forward: do block 3's working weights equal its fp32 masters rounded to bf16?
    decoder_layers(model)[3].register_forward_pre_hook(
        lambda m, a: seen.append(
            all(p.dtype == torch.bfloat16 and torch.equal(p, masters[id(p)].bfloat16()) for p in m.parameters())
        )
    )
    batch = token_batches(1)[0]
    losses = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
    for p in offload.offloaded_parameters:
        assert p.dtype == p.grad.dtype == torch.float32
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    assert not all(torch.equal(a, b) for a, b in grads)  # the blocks really ran in bf16
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=0.1, atol=2e-3)
    # The bf16 copies follow the optimizer's updates of the fp32 masters.
    optimizer = offload.build_optimizer(lr=1e-2)
    for _ in range(2):
        optimizer.step()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
    assert seen == [True, True, True]


def test_autocast_without_compute_dtype_warns_once():
    """Autocast would cache a bf16 cast of every offloaded weight from forward to backward: offload would free no
    weight memory. Running the blocks in the autocast dtype (`compute_dtype`) avoids it, and then nothing warns."""
    batch = token_batches(1)[0]
    model = tiny_model().train()
    GranularOffload(model, 0.5)
    with pytest.warns(UserWarning, match=r"offload: cpu autocast to torch.bfloat16 .* compute_dtype=torch.bfloat16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()  # once per offload
        model(input_ids=batch, labels=batch).loss.backward()  # no autocast: nothing to say
        matched = tiny_model().train()
        GranularOffload(matched, 0.5, compute_dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            matched(input_ids=batch, labels=batch).loss.backward()


def test_low_precision_gradients_accumulate_into_the_masters_dtype_exactly(monkeypatch):
    """Each bf16 gradient is added to the fp32 `.grad` in one pass (type promotion), equal bit for bit to adding its
    fp32 conversion."""
    model = tiny_model().train()
    offload = GranularOffload(model, [2], compute_dtype=torch.bfloat16)
    parts = {}
    collect = offload._collect

    def spy(p, event, norm):
        parts.setdefault(p, []).append(offload._host[p][1].clone())
        collect(p, event, norm)

    monkeypatch.setattr(offload, "_collect", spy)
    for batch in token_batches(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
    for p in offload.offloaded_parameters:
        assert [g.dtype for g in parts[p]] == [torch.bfloat16] * 3 and p.grad.dtype == torch.float32
        expected = parts[p][0].float()
        for g in parts[p][1:]:
            expected = expected + g.float()
        assert torch.equal(p.grad, expected)


# ------------------------------------------------------------------------------- the optimizer step on the device


def _step_calls(optimizer) -> list[int]:
    """Parameters with a gradient at each call of the optimizer's own step (its step hooks fire per call)."""
    calls = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: calls.append(sum(p.grad is not None for g in opt.param_groups for p in g["params"]))
    )
    return calls


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 2**30], ids=["per-tensor", "chunks", "one-chunk"])
@pytest.mark.parametrize("offload_clip", [False, True], ids=["torch-clip", "offload-clip"])
def test_device_chunked_step_equals_training_without_offload(overrides, accumulation, chunk_bytes, offload_clip):
    """The offloaded parameters stepped on the compute device, a chunk at a time (on the CPU the copies in and out are
    CPU copies; with the offload's clip, the offloaded gradients scaled there): the same weights as without offload,
    bit for bit."""
    expected, _ = _train(tiny_model(**overrides), accumulation=accumulation)
    got, offload = _train(
        tiny_model(**overrides),
        0.5,
        accumulation=accumulation,
        optimizer_step="device_chunked",
        chunk_bytes=chunk_bytes,
        offload_clip=offload_clip,
    )
    assert offload.layers and offload.copied_bytes["to_host"] > 0
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_device_chunked_steps_each_chunk_alone_within_the_bound():
    model = tiny_model().train()
    offload = GranularOffload(model, [1, 3], optimizer_step="device_chunked", chunk_bytes=30_000)
    optimizer = offload.build_optimizer(lr=1e-2)
    calls = _step_calls(optimizer)
    offloaded = offload.offloaded_parameters
    for batch in token_batches(2):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        assert all(p.grad is not None and p.device.type == "cpu" for p in offloaded)  # as after any step
        optimizer.zero_grad()
    resident = sum(1 for p in model.parameters()) - len(offloaded)
    # Per step: the resident parameters, then chunks of offloaded ones in order, each within 30,000 bytes of
    # parameters, gradients and two AdamW moments (16 bytes per fp32 element), a larger tensor alone.
    sizes = [16 * p.numel() for p in offloaded]
    chunks, size = [0], 0
    for nbytes in sizes:
        if chunks[-1] and size + nbytes > 30_000:
            chunks.append(0)
            size = 0
        chunks[-1] += 1
        size += nbytes
    assert len(chunks) > 2 and max(sizes) > 30_000  # several chunks, one tensor alone
    assert calls == ([resident, *chunks]) * 2
    for p in offloaded:
        assert {k: v.device.type for k, v in optimizer.state[p].items()} == {
            "exp_avg": "cpu",
            "exp_avg_sq": "cpu",
            "step": "cpu",
        }


@pytest.mark.parametrize(
    ("optimizer_cls", "options"),
    [
        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=1e-2, foreach=False)),
        (torch.optim.AdamW, dict(lr=1e-2, foreach=True)),
        (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5)),
        (torch.optim.Adagrad, dict(lr=1e-2)),
        (torch.optim.NAdam, dict(lr=1e-2)),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
@pytest.mark.parametrize("optimizer_step", ["host", "device_chunked"])
def test_any_torch_optimizer_through_build_optimizer_equals_it_without_offload(optimizer_cls, options, optimizer_step):
    model, reference = tiny_model().train(), tiny_model().train()
    offload = GranularOffload(model, 0.5, optimizer_step=optimizer_step, chunk_bytes=40_000)
    optimizer = offload.build_optimizer(optimizer_cls=optimizer_cls, **options)
    plain = optimizer_cls(reference.parameters(), **options)
    assert type(optimizer) is optimizer_cls
    _assert_trained_alike((model, optimizer), (reference, plain))
    assert all(v.device.type == "cpu" for p in offload.offloaded_parameters for v in optimizer.state[p].values())


@pytest.mark.parametrize(
    "design",
    [dict(overlap_step=True), dict(optimizer_step="device_chunked", chunk_bytes=30_000)],
    ids=["host", "chunked"],
)
def test_the_trainers_muon_steps_offloaded_blocks_in_both_designs(design):
    """The trainer's `optimizer: muon` (MuonAdamW: torch's Muon and AdamW as inner optimizers) through
    `build_optimizer`: on the device in chunks, and on the host (at once: `overlap_step` copies only torch classes)."""
    from hf_p2r.training.config import TrainArguments
    from hf_p2r.training.optim import MuonAdamW, build_optimizer

    args = TrainArguments(optimizer="muon", weight_decay=0.1, learning_rate=1e-2, muon_learning_rate=2e-2)
    model, reference = tiny_model().train(), tiny_model().train()
    offload = GranularOffload(model, [1, 3], **design)
    optimizer = build_optimizer(model, args, offload)
    assert isinstance(optimizer, MuonAdamW) and not offload._overlapping
    reference_optimizer = build_optimizer(reference, args)
    _assert_trained_alike((model, optimizer), (reference, reference_optimizer), steps=2, lr=1e-2)


def test_device_chunked_casts_the_copies_to_send_on_the_device():
    """With `compute_dtype`, the bf16 copies the next forward sends are made from the stepped chunk (on the device)
    and match the fp32 masters rounded; the next forward has nothing to convert on the host."""
    model = tiny_model().train()
    offload = GranularOffload(model, 1.0, compute_dtype=torch.bfloat16, optimizer_step="device_chunked", chunk_bytes=1)
    optimizer = offload.build_optimizer(lr=1e-2)
    batch = token_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    assert not offload._stale
    for block in offload._blocks.values():
        for p, master, source, version in zip(block.params, block.masters, block.sources, block.versions):
            assert source.dtype == torch.bfloat16 and torch.equal(source, master.bfloat16())
            assert version == tensor_version(p)


def test_device_chunked_state_round_trips_through_a_state_dict():
    """A resumed optimizer (its state loaded as plain CPU tensors) continues exactly like the one it was saved from."""
    runs = []
    for resume in (False, True):
        model = tiny_model().train()
        offload = GranularOffload(model, 0.5, optimizer_step="device_chunked", chunk_bytes=40_000)
        optimizer = offload.build_optimizer(lr=1e-2, weight_decay=0.1)
        for i, batch in enumerate(token_batches(4)):
            if resume and i == 2:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = offload.build_optimizer(lr=1e-2, weight_decay=0.1)
                optimizer.load_state_dict(saved)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_optimizer_step_and_chunk_bytes_name_the_argument():
    with pytest.raises(ValueError, match="^offload: optimizer_step must be one of host, device_chunked, got 'gpu'"):
        GranularOffload(tiny_model(), 0.5, optimizer_step="gpu")
    with pytest.raises(ValueError, match="^offload: chunk_bytes must be a positive integer, got 0"):
        GranularOffload(tiny_model(), 0.5, chunk_bytes=0)


# ------------------------------------------------------------------------------------ the overlapped host step


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("offload_clip", [False, True], ids=["torch-clip", "offload-clip"])
def test_overlapped_host_step_equals_training_without_offload(overrides, accumulation, offload_clip):
    """Each offloaded block stepped on the worker while the next forward runs (with the offload's clip, its scaling
    of the offloaded gradients deferred to those steps): the same weights as without offload, bit for bit."""
    expected, _ = _train(tiny_model(**overrides), accumulation=accumulation)
    got, offload = _train(
        tiny_model(**overrides), 0.5, accumulation=accumulation, overlap_step=True, offload_clip=offload_clip
    )
    assert offload.overlap_step and offload.layers
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_overlapped_steps_finish_before_their_block_is_used(monkeypatch):
    """A gated worker (the blocks' steps start 50 ms after `optimizer.step()` has returned, while the next forward or
    `state_dict()` is already called): each block's next forward starts only after its own step, `state_dict()` waits
    for the last step's blocks, and the result is training without offload's."""
    model, reference = tiny_model(**PSEUDO).train(), tiny_model(**PSEUDO).train()
    offload = GranularOffload(model, 1.0, overlap_step=True)
    optimizer = offload.build_optimizer(lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    events, gate = [], threading.Semaphore(0)
    step_block = offload._step_block

    def gated(block, *args):
        gate.acquire()
        step_block(block, *args)
        events.append(("stepped", block.index))

    monkeypatch.setattr(offload, "_step_block", gated)
    for index, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda module, args, index=index: events.append(("forward", index)))
    for i, batch in enumerate(token_batches(3)):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        events.append(("returned", i))
        assert all(p.grad is None for p in offload.offloaded_parameters)  # handed to the steps
        assert len(offload._steps) == 2  # neither block stepped yet
        optimizer.zero_grad()
        threading.Timer(0.05, gate.release, args=(2,)).start()  # the next forward (or state_dict) starts at once
    saved = model.state_dict()  # waits for the last step's blocks
    for batch in token_batches(3):
        reference(input_ids=batch, labels=batch).loss.backward()
        plain.step()
        plain.zero_grad()
    # Both blocks are stepped after step() returned, in the order the forward needs them (0 first), each before its
    # first use (the forward of block 0 fetches block 1 ahead: it waits for both).
    for i in range(2):
        after = events[events.index(("returned", i)) :]
        assert after[1:3] == [("stepped", 0), ("stepped", 1)]
        assert after.index(("stepped", 0)) < after.index(("forward", 0))
        assert after.index(("stepped", 1)) < after.index(("forward", 1))
    for name, value in reference.state_dict().items():
        assert torch.equal(saved[name], value), name
    assert not offload._steps


def test_the_backward_waits_for_gradient_copies_only_beyond_the_bound():
    """The CUDA gradient path's bound, with stand-in events (done or not; waiting on one completes it): a copy is
    waited for only while more than `max_inflight_bytes` are in flight, oldest first; copies known done are dropped
    without waiting."""

    class Event:
        def __init__(self, name, done=False):
            self.name, self.done = name, done

        def query(self):
            return self.done

        def synchronize(self):  # a wait only for a copy not done yet
            if not self.done:
                waited.append(self.name)
            self.done = True

    waited = []
    offload = GranularOffload(tiny_model(), [1], max_inflight_bytes=100)
    bound = offload._bound_inflight
    bound(Event("a"), 60)
    bound(Event("b"), 40)  # 100 in flight: within the bound
    assert waited == [] and offload._inflight_bytes == 100
    bound(Event("c"), 30)  # 130: the oldest waited for, then 70
    assert waited == ["a"] and offload._inflight_bytes == 70
    offload._inflight[0][0].done = True  # "b" finished by itself
    bound(Event("d"), 10)  # dropped without waiting
    assert waited == ["a"] and [e.name for e, _ in offload._inflight] == ["c", "d"] and offload._inflight_bytes == 40
    bound(Event("e"), 500)  # one copy larger than the bound: everything before it, and it, waited for
    assert waited == ["a", "c", "d", "e"] and offload._inflight_bytes == 0
    default = GranularOffload(tiny_model(), [1, 2])
    assert default.max_inflight_bytes == _block_bytes(tiny_model())  # one block of gradients (fp32 here)


# -------------------------------------------------------------------------------------------- gradient clipping


def _measured_in_clip(monkeypatch, offload, clip):
    """Run `clip()`; returns the gradients whose norm it measured (`torch.linalg.vector_norm` calls on them)."""
    measured, norm = [], torch.linalg.vector_norm

    def spy(tensor, *args, **kwargs):
        measured.append(tensor)
        return norm(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    try:
        total = clip()
    finally:
        monkeypatch.setattr(torch.linalg, "vector_norm", norm)
    offloaded = {id(p.grad) for p in offload.offloaded_parameters}
    return total, [t for t in measured if id(t) in offloaded]


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("checkpointing", [None, True], ids=["plain", "reentrant"])
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipped", "unclipped"])
def test_clip_norm_equals_torch_without_measuring_offloaded_gradients(
    monkeypatch, overrides, checkpointing, accumulation, max_norm
):
    """The norm `GranularOffload.clip_grad_norm_` returns and the gradients it leaves are torch's `clip_grad_norm_`
    over the same model without offload, bit for bit on one device, and it measures no offloaded gradient: each was
    measured as it left the device (one backward) or by the worker that summed the backwards' parts (accumulation;
    a pseudo model's shared block under reentrant checkpointing sums parts within one backward too)."""
    models = [tiny_model(**overrides).train() for _ in range(2)]
    if checkpointing is not None:
        for model in models:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    offload = GranularOffload(models[0], 0.5)
    for batch in token_batches(accumulation):
        for model in models:
            model(input_ids=batch, labels=batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(models[1].parameters(), max_norm)
    total, measured = _measured_in_clip(
        monkeypatch, offload, lambda: offload.clip_grad_norm_(models[0].parameters(), max_norm)
    )
    assert measured == []
    assert torch.equal(total, expected)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_clip_measures_gradients_changed_since_they_left_the_device(monkeypatch):
    """A gradient scaled (fp16's unscaling), replaced or set after backward is measured again, not taken from the
    norm recorded when it left the device."""
    model = tiny_model().train()
    offload = GranularOffload(model, [1, 3])
    batch = token_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    offloaded = offload.offloaded_parameters
    offloaded[0].grad.mul_(0.5)  # in place: its version counter moves
    offloaded[1].grad = offloaded[1].grad * 2.0  # a new tensor
    reference = [p.grad.clone() for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(reference)
    total, measured = _measured_in_clip(monkeypatch, offload, lambda: offload.clip_grad_norm_(model.parameters(), 1e6))
    assert [id(t) for t in measured] == [id(offloaded[0].grad), id(offloaded[1].grad)]
    assert torch.equal(total, expected)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clip_norm_under_bf16_equals_torch_over_the_fp32_gradients(monkeypatch, accumulation):
    """Offloaded blocks in bf16 (autocast, `compute_dtype`): their gradients leave the device in bf16 and their norm
    is taken there in fp32; it equals torch's norm of the fp32 `.grad` they are accumulated into (within fp32
    rounding), and no offloaded gradient is measured by the clip."""
    model = tiny_model().train()
    offload = GranularOffload(model, 0.5, compute_dtype=torch.bfloat16)
    for batch in token_batches(accumulation):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(p.grad.dtype == torch.float32 for p in offload.offloaded_parameters)
    expected = torch.nn.utils.get_total_norm(grads)
    total, measured = _measured_in_clip(monkeypatch, offload, lambda: offload.clip_grad_norm_(model.parameters(), 0.05))
    assert measured == []
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for p, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, grad * (0.05 / (expected + 1e-6)), rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------------------------------------- GPU


def _cuda_model(num_hidden_layers=8, **overrides):
    # Eager attention: fp32 SDPA backward on CUDA may pick a nondeterministic kernel, and the equality test compares
    # two runs.
    shape = presets.model(hidden=256, ffn=768, heads=8, kv_heads=4, layers=num_hidden_layers, vocab=512)
    return tiny_model(attn_implementation="eager", **shape, **overrides).train()


@requires_cuda
def test_cuda_peak_memory_falls_as_the_ratio_rises():
    peaks = []
    for ratio in (0.0, 0.5, 1.0):
        model = _cuda_model()
        offload = GranularOffload(model, ratio, device="cuda")
        optimizer = offload.build_optimizer(lr=1e-3)
        batch = torch.randint(3, 512, (2, 64), device="cuda")
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        # Offloaded masters and gradients are pinned host memory.
        assert all(p.is_pinned() for p in offload.offloaded_parameters)
        offload.remove()
        del model, optimizer, offload
        torch.cuda.empty_cache()
    assert peaks[0] > peaks[1] > peaks[2], peaks


# What training with offload on CUDA can promise against training without, after 3 AdamW steps (lr 1e-2), per
# parameter tensor: the difference is at most 1e-4 of how far training moved it (norms), and no weight is off by more
# than 1e-4 (1% of one step's learning rate). Not equality: the offloaded half is stepped by the CPU AdamW kernel, and
# the norm that clipping uses takes its gradients' norms on the CPU; both round differently from CUDA's kernels in the
# last bit. AdamW's update m / sqrt(v) amplifies last-bit differences in the few elements whose gradient nearly
# cancels, and the changed weights feed the next steps. The first GPU run saw exactly that: all 4 cases failed on
# `model.embed_tokens.weight` at rtol 1e-5, atol 1e-6, also with deterministic algorithms. Reproduced on CPU by
# stepping the offloaded half with foreach instead of fused AdamW (another rounding, same mechanism): 3 of 6.6M (real)
# and 4 of 1.8M (pseudo) elements beyond rtol 1e-5, atol 1e-6, all in embed_tokens, the largest 9.1e-6; norm ratio at
# most 4.5e-6 (test_a_last_bit_difference_in_the_host_optimizer_stays_within_the_cuda_bound); with the clipping norm
# also summed in another order, 17 elements (real), the same largest difference and ratio. The bound leaves a
# factor of 10 over the largest element and of 20 over the norm ratio for CUDA's roundings; it is unverified on a GPU.
OFFLOAD_NORM_RATIO, OFFLOAD_MAX_ABS = 1e-4, 1e-4


def _assert_within_offload_bound(got: dict, expected: dict, initial: dict) -> None:
    for name, value in expected.items():
        difference, moved = (got[name] - value).norm(), (value - initial[name]).norm()
        assert difference <= OFFLOAD_NORM_RATIO * moved, (name, (difference / moved).item())
        assert (got[name] - value).abs().max() <= OFFLOAD_MAX_ABS, (name, (got[name] - value).abs().max().item())


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
def test_a_last_bit_difference_in_the_host_optimizer_stays_within_the_cuda_bound(overrides):
    """The CUDA equality test's bound, on CPU: the same model and training with another AdamW rounding for the
    offloaded half (foreach instead of fused) stays within it. (On the machine that wrote this, it also failed the
    old elementwise tolerance, in embed_tokens only, as the GPU run did; how many elements do depends on the CPU.)"""
    initial = {name: p.detach() for name, p in _cuda_model(**overrides).named_parameters()}
    expected, _ = _train(_cuda_model(**overrides), 0.5, accumulation=2)
    got, _ = _train(_cuda_model(**overrides), 0.5, accumulation=2, host_optimizer={"fused": None, "foreach": True})
    assert not all(torch.equal(got[name], value) for name, value in expected.items())  # the roundings differ
    _assert_within_offload_bound(got, expected, initial)


CUDA_DESIGNS = {
    "host": {},
    # As the trainer runs it: each block's CPU step overlapped with the next forward, the offload's clip.
    "host-overlapped": dict(overlap_step=True, offload_clip=True),
    "device_chunked": dict(optimizer_step="device_chunked", chunk_bytes=2**20, offload_clip=True),
    # Issue 40: the gradients summed on the device and sent by the step's last micro-batch (of 2).
    "device-sums": dict(grad_accumulation="device", overlap_step=True, offload_clip=True, micro_batches=2),
    "device-sums-chunked": dict(
        grad_accumulation="device", optimizer_step="device_chunked", offload_clip=True, micro_batches=2
    ),
}


@requires_cuda
@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("checkpointing", [None, False])
@pytest.mark.parametrize("design", list(CUDA_DESIGNS))
def test_cuda_training_with_offload_matches_training_without(overrides, checkpointing, design):
    """Exact: the gradients of the first optimizer step (two micro-batches, before clipping): the same kernels on the
    same weights, the offloaded blocks' gradients summed on the host in fp32 as autograd sums them on the device.
    Bounded: the weights after 3 steps (`OFFLOAD_NORM_RATIO`, `OFFLOAD_MAX_ABS`; see there why not equal), in each
    design of the offloaded blocks' step (device_chunked: the state back in pinned host memory)."""
    initial = {name: p.detach().clone() for name, p in _cuda_model(**overrides).named_parameters()}
    expected_grads, got_grads = {}, {}
    expected, _ = _train(
        _cuda_model(**overrides), device="cuda", checkpointing=checkpointing, accumulation=2, first_grads=expected_grads
    )
    options = dict(CUDA_DESIGNS[design])
    if "micro_batches" in options:
        options["last_micro_batch"] = LastMicroBatch(options.pop("micro_batches"))
    got, offload = _train(
        _cuda_model(**overrides),
        0.5,
        device="cuda",
        checkpointing=checkpointing,
        accumulation=2,
        first_grads=got_grads,
        **options,
    )
    assert offload.copied_bytes["to_host"] > 0
    for p in offload.offloaded_parameters:
        assert p.device.type == "cpu" and p.is_pinned() and p.grad is None
    for name, value in expected_grads.items():
        assert torch.equal(got_grads[name], value), name
    _assert_within_offload_bound(got, expected, initial)


@requires_cuda
def test_cuda_device_memory_stays_bounded_when_the_cpu_runs_ahead():
    """A spin kernel before every block's forward and backward slows the GPU down, so the CPU queues the step far ahead
    of it. The offloaded blocks' memory must still be reused (the copies wait for the release events), not grow by a
    block per fetch: the peak stays within one block (of gradients) of the unhurried run's."""
    peaks = []
    for slow in (False, True):
        model = _cuda_model(num_hidden_layers=16)
        offload = GranularOffload(model, 1.0, device="cuda")
        if slow:

            def stall(*args):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time

            def stall_backward(module, args, output):
                output = output if isinstance(output, torch.Tensor) else output[0]
                output.register_hook(stall)

            for layer in decoder_layers(model):
                layer.register_forward_pre_hook(stall)
                layer.register_forward_hook(stall_backward)
        batch = torch.randint(3, 512, (2, 64), device="cuda")
        model(input_ids=batch, labels=batch).loss.backward()  # warm-up: allocator caches, kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=batch, labels=batch).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        offload.remove()
        del model, offload
        torch.cuda.empty_cache()
    block = _block_bytes(_cuda_model(num_hidden_layers=1))
    assert peaks[1] - peaks[0] <= block, (peaks, block)
