"""The designs that take the host off granular offload's critical path (issue 40), on the CPU (the compute device is
the CPU: every copy is CPU to CPU, the hooks, the worker and the optimizer steps run as on a GPU):

- `grad_accumulation="device"`: an offloaded block's gradient summed on the device over a step's micro-batches and
  sent once, by the last (`last_micro_batch`), handed over as `.grad` without a copy; the backwards before it wait
  for nothing;
- `update="during_backward"`: each block stepped as soon as its last gradient has landed, during the backward;
- `update="delayed"`: step t's host update runs during step t+1 (one step stale), optionally error-feedback
  corrected; `synchronize` drains it;
- `host_threads`: several worker threads.

The synchronous designs equal training without offload bit for bit (fp32); the delayed one equals a reference
implementation of its rule bit for bit.
"""

import copy

import pytest
import torch

from hf_p2r.distributed.delay import feed_back_error_
from hf_p2r.distributed.offload import GranularOffload, decoder_layers, estimate_device_bytes, estimate_host_bytes

from ..conftest import tiny_model
from .helpers import LastMicroBatch, token_batches

PSEUDO = dict(share_layers=True, num_unique_layers=2)
HYPER = dict(lr=1e-2, weight_decay=0.1, fused=True)


def _train(
    model, offload=None, *, steps=3, accumulation=1, checkpointing=None, clip=True, offload_clip=False, evals=None, **kw
):
    """AdamW (weight decay, clipping that bites unless `clip` is False) for `steps` steps of `accumulation`
    micro-batches; returns ({name: parameter}, the offload or None). `evals`: a list to which the logits of a forward
    without grad after each step are added."""
    model.train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    if offload is None:
        optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    else:
        kw.setdefault("last_micro_batch", LastMicroBatch(accumulation))
        offload = GranularOffload(model, offload, **kw)
        optimizer = offload.build_optimizer(**HYPER)
    for i, batch in enumerate(token_batches(steps * accumulation), 1):
        (model(input_ids=batch, labels=batch).loss / accumulation).backward()
        if i % accumulation == 0:
            if clip:
                (offload.clip_grad_norm_ if offload_clip else torch.nn.utils.clip_grad_norm_)(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
            if evals is not None:
                with torch.no_grad():
                    evals.append(model(input_ids=batch).logits)
    if offload is not None:
        offload.synchronize()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, offload


def _assert_equal(got, expected):
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# ------------------------------------------------------------------------------------- gradients summed on the device


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "checkpoint", "reentrant"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_device_accumulation_equals_training_without_offload(overrides, checkpointing, accumulation):
    expected, _ = _train(tiny_model(**overrides), accumulation=accumulation, checkpointing=checkpointing)
    got, offload = _train(
        tiny_model(**overrides),
        0.5,
        accumulation=accumulation,
        checkpointing=checkpointing,
        grad_accumulation="device",
        overlap_step=True,
        offload_clip=True,
    )
    block = sum(p.numel() * p.element_size() for p in offload.offloaded_parameters)
    assert offload.copied_bytes["to_host"] == 3 * block  # sent once per step, whatever the accumulation
    _assert_equal(got, expected)


def test_device_accumulation_without_last_micro_batch_sends_every_backward():
    """Without `last_micro_batch` every backward is a step's last: a sum is sent by each (and added on the host),
    still equal to training without offload."""
    expected, _ = _train(tiny_model(), accumulation=2)
    got, offload = _train(tiny_model(), 0.5, accumulation=2, grad_accumulation="device", last_micro_batch=None)
    block = sum(p.numel() * p.element_size() for p in offload.offloaded_parameters)
    assert offload.copied_bytes["to_host"] == 6 * block
    _assert_equal(got, expected)


def test_micro_batches_before_the_last_wait_for_nothing(monkeypatch):
    """A backward that is not the step's last hands nothing over and waits for no gradient; the last one hands the
    device sums over as `.grad`, each the parameter's staging buffer itself (no host copy), with its norm."""
    model = tiny_model().train()
    offload = GranularOffload(model, 0.5, grad_accumulation="device", last_micro_batch=LastMicroBatch(3))
    finished = []
    finish = offload._finish_gradients
    monkeypatch.setattr(offload, "_finish_gradients", lambda: (finished.append(1), finish()))
    batches = token_batches(3)
    for batch in batches[:2]:
        model(input_ids=batch, labels=batch).loss.backward()
        assert all(p.grad is None for p in offload.offloaded_parameters)
        assert len(offload._accumulated) == len(offload.offloaded_parameters)
    assert not finished and offload.copied_bytes["to_host"] == 0
    model(input_ids=batches[2], labels=batches[2]).loss.backward()
    assert finished == [1] and not offload._accumulated
    for p in offload.offloaded_parameters:
        assert p.grad.device.type == "cpu" and p.grad.data_ptr() == offload._host[p][1].data_ptr()
        norm, grad, _ = offload._norms[p]
        assert grad is p.grad and torch.equal(norm, torch.linalg.vector_norm(p.grad))
    offload.remove()  # the handed-over buffer leaves the slab as a gradient of its own
    grads = [p.grad for p in decoder_layers(model)[1].parameters()]
    assert all(g is not None and g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in grads)


def test_a_step_before_the_last_micro_batch_is_an_error():
    model = tiny_model().train()
    offload = GranularOffload(model, 0.5, grad_accumulation="device", overlap_step=True, last_micro_batch=lambda: False)
    optimizer = offload.build_optimizer(**HYPER)
    batch = token_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    with pytest.raises(RuntimeError, match="^offload: the optimizer steps while the gradients of .* still summed"):
        optimizer.step()


def test_bf16_accumulation_sums_and_sends_in_bf16():
    """`accumulation_dtype=torch.bfloat16`: the sum is made and sent in bf16 (half the bytes) and handed over in the
    masters' dtype; the result is the bf16 sum of the parts, not the fp32 one."""
    model, reference = tiny_model().train(), tiny_model().train()
    offload = GranularOffload(
        model, [1], grad_accumulation="device", accumulation_dtype=torch.bfloat16, last_micro_batch=LastMicroBatch(2)
    )
    for batch in token_batches(2):
        model(input_ids=batch, labels=batch).loss.backward()
        reference(input_ids=batch, labels=batch).loss.backward()
    params = list(decoder_layers(model)[1].parameters())
    assert offload.copied_bytes["to_host"] == sum(p.numel() * 2 for p in params)
    assert all(p.grad.dtype == torch.float32 for p in params)
    for p, q in zip(params, decoder_layers(reference)[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-4)
    assert not all(torch.equal(p.grad, q.grad) for p, q in zip(params, decoder_layers(reference)[1].parameters()))


# ----------------------------------------------------------------------------------- the update during the backward


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("grad_accumulation", ["host", "device"])
@pytest.mark.parametrize("checkpointing", [None, True], ids=["plain", "reentrant"])
def test_update_during_backward_equals_training_without_offload(
    overrides, accumulation, grad_accumulation, checkpointing
):
    """Each block stepped once its last part of the step has landed (a shared block under reentrant checkpointing
    sends a part per depth: the last one counts)."""
    expected, _ = _train(tiny_model(**overrides), accumulation=accumulation, clip=False, checkpointing=checkpointing)
    got, offload = _train(
        tiny_model(**overrides),
        0.5,
        accumulation=accumulation,
        clip=False,
        checkpointing=checkpointing,
        update="during_backward",
        grad_accumulation=grad_accumulation,
    )
    _assert_equal(got, expected)


def test_update_during_backward_steps_blocks_before_the_backward_ends(monkeypatch):
    """Each offloaded block's step starts while the backward still runs (the window is open), each after all of its
    gradients have landed; a clip afterwards is refused (the norm came too late for those blocks)."""
    model = tiny_model().train()
    offload = GranularOffload(model, [1, 3], update="during_backward")
    optimizer = offload.build_optimizer(**HYPER)
    submitted, landed = [], []
    submit, step_early = offload._worker.submit, offload._step_early

    def spy_submit(fn, *args):
        if getattr(fn, "__name__", "") == "spy_step":
            submitted.append((args[0].index, offload._window))  # on the main thread, in the backward's hooks
        return submit(fn, *args)

    def spy_step(block, tasks):
        landed.append(all(task.done() for task in tasks))  # one worker: its gradients were collected before
        step_early(block, tasks)

    monkeypatch.setattr(offload._worker, "submit", spy_submit)
    monkeypatch.setattr(offload, "_step_early", spy_step)
    batch = token_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    assert sorted(submitted) == [(1, True), (3, True)] and landed == [True, True]
    assert all(p.grad is None for p in offload.offloaded_parameters)  # consumed by their steps
    with pytest.raises(RuntimeError, match=r"^offload: update='during_backward' has already stepped .* \[1, 3\]"):
        offload.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()  # the resident part
    offload.synchronize()


def test_update_during_backward_needs_the_optimizer_first():
    model = tiny_model().train()
    GranularOffload(model, [1], update="during_backward")
    batch = token_batches(1)[0]
    with pytest.raises(RuntimeError, match="^offload: update='during_backward' steps each block with the optimizer"):
        model(input_ids=batch, labels=batch)


# -------------------------------------------------------------------------------------------- the delayed update


def _train_delayed_reference(model, offloaded, *, steps, accumulation, correction=False, clip=True):
    """The delayed rule on a plain model: each step's forward and backward see the offloaded blocks' weights of
    before the previous update (W(t-1) for the update of step t), the resident ones' current weights; one AdamW
    over all; with `correction`, error feedback on the offloaded parameters."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    stale_params = [p for i in offloaded for p in decoder_layers(model)[i].parameters()]
    sent = [p.detach().clone() for p in stale_params]
    previous: dict[int, torch.Tensor] = {}
    for i, batch in enumerate(token_batches(steps * accumulation), 1):
        current = [p.data for p in stale_params]
        for p, weights in zip(stale_params, sent):
            p.data = weights.clone()
        (model(input_ids=batch, labels=batch).loss / accumulation).backward()
        for p, weights in zip(stale_params, current):
            p.data = weights
        if i % accumulation == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            before = [p.detach().clone() for p in stale_params]
            optimizer.step()
            optimizer.zero_grad()
            if correction:
                for k, (p, old) in enumerate(zip(stale_params, before)):
                    previous[k] = feed_back_error_(p.data, old, previous.get(k))
            sent = before  # the next step sends the weights of before this update
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("overrides", [{}, PSEUDO], ids=["real", "pseudo"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("correction", ["none", "error_feedback"])
def test_delayed_update_equals_its_rule(overrides, accumulation, correction):
    """Bit for bit the reference delayed rule (one step stale, corrected or not), with the device sums and the
    offload's clip, an evaluation after each step seeing the newest weights (every update made) without changing
    the rule; and not training without offload (the control: the delay changes the weights)."""
    offloaded = [1]
    expected = _train_delayed_reference(
        tiny_model(**overrides), offloaded, steps=4, accumulation=accumulation, correction=correction != "none"
    )
    evals = []
    got, offload = _train(
        tiny_model(**overrides),
        offloaded,
        steps=4,
        accumulation=accumulation,
        evals=evals,
        update="delayed",
        delay_correction=correction,
        grad_accumulation="device",
        offload_clip=True,
    )
    _assert_equal(got, expected)
    reference = tiny_model(**overrides).eval()
    reference.load_state_dict(got)
    batch = token_batches(4 * accumulation)[-1]
    with torch.no_grad():
        assert torch.equal(evals[-1], reference(input_ids=batch).logits)  # the last evaluation: the final weights
    plain, _ = _train(tiny_model(**overrides), steps=4, accumulation=accumulation)
    assert not torch.equal(got["model.layers.1.mlp.up_proj.weight"], plain["model.layers.1.mlp.up_proj.weight"])


def test_delayed_update_runs_during_the_next_step_and_synchronize_drains_it():
    """Each block's update is still pending when the next forward starts (its fetch does not wait), and sends the
    copies of before it; `synchronize` applies it and the next forward sends the newest weights: a run that
    synchronises (a checkpoint) and one resumed from that state continue alike, bit for bit."""
    model = tiny_model().train()
    offload = GranularOffload(model, [1], update="delayed", grad_accumulation="device")
    optimizer = offload.build_optimizer(**HYPER)
    batches = token_batches(6)
    for batch in batches[:2]:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    block = offload._blocks[1]
    assert block.swap_pending
    offload.synchronize()
    assert not block.swap_pending and all(torch.equal(s, m) for s, m in zip(block.sources, block.masters))
    state = {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict())
    for batch in batches[2:]:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    offload.synchronize()
    continued = {k: v.clone() for k, v in model.state_dict().items()}

    resumed = tiny_model().train()
    resumed.load_state_dict(state[0])
    offload2 = GranularOffload(resumed, [1], update="delayed", grad_accumulation="device")
    optimizer2 = offload2.build_optimizer(**HYPER)
    optimizer2.load_state_dict(state[1])
    for batch in batches[2:]:
        resumed(input_ids=batch, labels=batch).loss.backward()
        optimizer2.step()
        optimizer2.zero_grad()
    offload2.synchronize()
    _assert_equal(resumed.state_dict(), continued)


# ------------------------------------------------------------------------------------------------ host threads


@pytest.mark.parametrize("update", ["after_backward", "during_backward"])
def test_several_host_threads_equal_training_without_offload(update):
    clip = update == "after_backward"
    expected, _ = _train(tiny_model(), accumulation=2, clip=clip)
    got, offload = _train(
        tiny_model(),
        1.0,
        accumulation=2,
        clip=clip,
        host_threads=3,
        overlap_step=True,
        update=update,
        grad_accumulation="device",
        offload_clip=clip,
    )
    assert offload._worker._max_workers == 3
    _assert_equal(got, expected)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_device_sums_stepped_in_chunks_on_the_device_equal_training_without_offload(accumulation):
    """`grad_accumulation="device"` with `optimizer_step="device_chunked"` (the table's last design): the sums handed
    over as `.grad` are stepped a chunk at a time (chunks smaller than a weight), bit for bit as without offload."""
    expected, _ = _train(tiny_model(), accumulation=accumulation)
    got, offload = _train(
        tiny_model(),
        0.5,
        accumulation=accumulation,
        grad_accumulation="device",
        optimizer_step="device_chunked",
        chunk_bytes=1024,
        offload_clip=True,
    )
    assert offload.optimizer_step == "device_chunked" and offload.grad_accumulation == "device"
    _assert_equal(got, expected)


# ------------------------------------------------------------------------------------- options and their estimates


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_accumulation": "gpu"}, "grad_accumulation must be one of host, device, got 'gpu'"),
        ({"update": "later"}, "update must be one of after_backward, during_backward, delayed, got 'later'"),
        ({"delay_correction": "x", "update": "delayed"}, "delay_correction must be one of none, error_feedback"),
        ({"update": "delayed", "optimizer_step": "device_chunked"}, "update='delayed' steps the offloaded blocks"),
        ({"delay_correction": "error_feedback"}, "delay_correction='error_feedback' corrects update='delayed' only"),
        ({"accumulation_dtype": torch.bfloat16}, "accumulation_dtype is the dtype of grad_accumulation='device'"),
        ({"host_threads": 0}, "host_threads must be a positive integer, got 0"),
    ],
)
def test_bad_options_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match="^offload: " + message.replace("(", r"\(").replace("[", r"\[")):
        GranularOffload(tiny_model(), 0.5, **kwargs)


def test_an_optimizer_that_is_not_torchs_is_refused_for_the_host_updates():
    class Mine(torch.optim.AdamW):
        pass

    Mine.__module__ = "somewhere"
    offload = GranularOffload(tiny_model(), 0.5, update="delayed")
    with pytest.raises(ValueError, match="^offload: update='delayed' steps blocks through views of a torch.optim"):
        offload.build_optimizer(optimizer_cls=Mine, lr=1e-3)


def test_estimates_count_the_device_sums_and_the_delayed_copies():
    model = tiny_model()
    block = sum(p.numel() for p in decoder_layers(model)[1].parameters())
    plain = estimate_device_bytes(model, [1, 3])
    assert estimate_device_bytes(model, [1, 3], accumulation_dtype=torch.bfloat16) == plain + 2 * block * 2
    assert estimate_device_bytes(model, [1, 3], accumulation_dtype=torch.float32) == plain + 2 * block * 4
    for kwargs, grad_dtype in (({}, None), ({"grad_accumulation": "device"}, torch.float32)):
        for delayed in (False, True):
            offload = GranularOffload(tiny_model(), [1, 3], update="delayed" if delayed else "after_backward", **kwargs)
            slabs = sum(b.slab.numel() for b in offload._blocks.values())
            host = estimate_host_bytes(
                offload.model, [1, 3], pinned=False, grad_dtype=grad_dtype, delayed=delayed, optimizer_states=2
            )
            gradients = 0 if grad_dtype is not None else 2 * block * 4  # the `.grad` besides the staging buffer
            assert host == slabs + 2 * 2 * block * 4 + gradients, (kwargs, delayed)


def test_feed_back_error_adds_the_change_of_update():
    param, before = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5])
    first = feed_back_error_(param, before, None)
    assert torch.equal(first, torch.tensor([0.5, -0.5])) and torch.equal(param, torch.tensor([1.0, 2.0]))
    second = feed_back_error_(param, torch.tensor([0.0, 2.0]), first)  # d = [1, 0]: param += [0.5, 0.5]
    assert torch.equal(second, torch.tensor([1.0, 0.0])) and torch.equal(param, torch.tensor([1.5, 2.5]))
