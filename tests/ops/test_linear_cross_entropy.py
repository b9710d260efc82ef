"""linear_cross_entropy against the plain path (`F.linear`, then transformers' `ForCausalLMLoss`): equal loss and
gradients, and no tokens x vocab tensor saved for backward.

Tolerances, as the largest difference over the largest value of the plain path's tensor (max-norm relative):
- fp32: 1e-6 for the loss and every gradient (measured: at most 3e-7);
- bf16: 1e-6 for the loss (each chunk's logits are the plain path's rows, upcast the same way), 2^-8 for the hidden
  states' gradient (measured: bitwise equal), 2^-7 for the weight's and the bias' (measured: up to 4.7e-3, the plain
  path rounds one matmul over all tokens to bf16 once, the chunked path each chunk's, summed in fp32; against an fp64
  reference both are off by the same order);
- fp64 (gradcheck): torch's defaults, the op's sums in fp64.
"""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_p2r.ops import linear_cross_entropy

from ..conftest import requires_cuda, tiny_model

TOLERANCE = {
    torch.float32: {"loss": 1e-6, "hidden": 1e-6, "weight": 1e-6, "bias": 1e-6},
    torch.bfloat16: {"loss": 1e-6, "hidden": 2**-8, "weight": 2**-7, "bias": 2**-7},
}


def plain(hidden, weight, labels, bias=None, **kwargs):
    """What P2RForCausalLM computes: every position's logits, then transformers' causal-LM loss."""
    return ForCausalLMLoss(F.linear(hidden, weight, bias), labels, weight.shape[0], **kwargs)


def inputs(shape=(3, 17), hidden=16, vocab=50, dtype=torch.float32, bias=True, ignored=5, seed=0):
    """(hidden states, weight, bias or None, labels) with the first `ignored` labels of the first row ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, vocab, shape, generator=g)
    labels.view(-1)[:ignored] = -100
    return h, w, b, labels


def loss_and_grads(fn, h, w, b, labels, scale=1.0, **kwargs):
    """fn's loss and the gradients of `scale * loss` w.r.t. fresh leaf copies of h, w (and b)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    loss = fn(leaves[0], leaves[1], labels, bias=leaves[2], **kwargs)
    (loss * scale).backward()
    return {"loss": loss.detach(), **{k: t.grad for k, t in zip(("hidden", "weight", "bias"), leaves) if t is not None}}


def relative_error(a: torch.Tensor, reference: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - reference| / max(max |reference|, floor) (0 where both are 0).

    `floor`: the size of one summand of `reference`, where it is a sum that can cancel (a bias gradient over a
    two-word vocabulary is a sum of +-p terms): rounding is relative to the terms, not to what is left of them."""
    a, reference = a.double(), reference.double()
    scale = max(reference.abs().max().item(), floor)
    difference = (a - reference).abs().max().item()
    return difference / scale if scale else difference


def assert_same(ours: dict, reference: dict, tolerance: dict, floor: float = 0.0) -> None:
    assert ours.keys() == reference.keys()
    for name, value in ours.items():
        assert value.dtype == reference[name].dtype and value.shape == reference[name].shape, name
        if name == "loss" and reference[name].isnan():
            assert value.isnan()
            continue
        assert relative_error(value, reference[name], 0.0 if name == "loss" else floor) <= tolerance[name], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 5, 51, 52, 1000, None])  # 51 tokens: all, one more, many more
def test_loss_and_gradients_equal_the_plain_path(dtype, chunk_size):
    h, w, b, labels = inputs(dtype=dtype)
    reference = loss_and_grads(plain, h, w, b, labels)
    ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=chunk_size, backend="chunked")
    assert_same(ours, reference, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_items_in_batch_divides_the_sum_and_scaled_outputs_scale_the_gradients(dtype):
    h, w, b, labels = inputs(dtype=dtype, ignored=9)
    for num_items in (7, torch.tensor(40), 1):
        kwargs = {"num_items_in_batch": num_items}
        reference = loss_and_grads(plain, h, w, b, labels, scale=0.25, **kwargs)
        ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, scale=0.25, chunk_size=4, **kwargs)
        assert_same(ours, reference, TOLERANCE[dtype])


def test_shift_false_takes_labels_as_each_positions_target():
    h, w, b, targets = inputs(ignored=3)
    reference = loss_and_grads(plain, h, w, b, None, shift_labels=targets)
    ours = loss_and_grads(linear_cross_entropy, h, w, b, targets, shift=False, chunk_size=8)
    assert_same(ours, reference, TOLERANCE[torch.float32])


def test_one_sequence_in_two_dims_is_a_batch_of_one():
    h, w, b, labels = inputs(shape=(1, 23))
    batch = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=6)
    single = loss_and_grads(linear_cross_entropy, h[0], w, b, labels[0], chunk_size=6)
    assert torch.equal(batch["loss"], single["loss"])
    assert torch.equal(batch["hidden"][0], single["hidden"]) and torch.equal(batch["weight"], single["weight"])


def test_non_contiguous_inputs():
    h, w, b, labels = inputs(shape=(3, 34), hidden=16)
    h = h[:, ::2]  # every other position: strided
    w = w.t().contiguous().t()  # column-major (vocab, hidden): a transposed (hidden, vocab) parameter
    labels = labels[:, ::2]
    assert not h.is_contiguous() and not w.is_contiguous()
    reference = loss_and_grads(plain, h, w, b, labels)
    ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=7)
    assert_same(ours, reference, TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_items", [None, 4])
def test_every_token_ignored(num_items):
    """The mean over no tokens is NaN with zero gradients (F.cross_entropy's 0 / 0); with num_items_in_batch, 0."""
    h, w, b, labels = inputs(shape=(2, 5), ignored=10)
    reference = loss_and_grads(plain, h, w, b, labels, num_items_in_batch=num_items)
    ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, num_items_in_batch=num_items, chunk_size=3)
    assert_same(ours, reference, TOLERANCE[torch.float32])
    assert ours["loss"].isnan() == (num_items is None)
    assert all(not g.any() for name, g in ours.items() if name != "loss")


def test_under_cpu_autocast_matmuls_run_in_bf16_and_gradients_come_back_in_fp32():
    h, w, b, labels = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = loss_and_grads(plain, h, w, b, labels)
        ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=10)
    assert ours["weight"].dtype == torch.float32
    assert_same(ours, reference, TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("tied", [True, False])
def test_the_engines_call_equals_the_models_loss_tied_head_included(tied, input_ids):
    """`linear_cross_entropy(model.model(...).last_hidden_state, model.lm_head.weight, labels)`, as the module's
    docstring tells an engine, equals `model(input_ids, labels=labels).loss`, and so do the gradients of every
    parameter (with tied embeddings the head's gradient adds to the embedding's, the same tensor)."""
    model = tiny_model(tie_word_embeddings=tied).train()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    labels = input_ids.clone()
    labels[0, :4] = -100

    model(input_ids=input_ids, labels=labels).loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=input_ids).last_hidden_state
    linear_cross_entropy(hidden, model.lm_head.weight, labels, chunk_size=5).backward()

    for name, p in model.named_parameters():
        assert relative_error(p.grad, reference[name]) <= 1e-5, name


def test_without_grad_only_the_loss_is_computed():
    h, w, b, labels = inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, bias=b, chunk_size=4)
    assert not loss.requires_grad
    assert relative_error(loss, plain(h, w, labels, b)) <= 1e-6


def test_auto_is_the_chunked_backend_off_cuda():
    h, w, b, labels = inputs()
    auto = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=7)
    chunked = loss_and_grads(linear_cross_entropy, h, w, b, labels, chunk_size=7, backend="chunked")
    assert all(torch.equal(auto[name], chunked[name]) for name in auto)


def test_auto_off_cuda_never_imports_liger_kernel():
    """Liger-Kernel (and Triton with it) is imported only for CUDA tensors, whether or not it is installed."""
    imported = "liger_kernel" in sys.modules
    h, w, b, labels = inputs()
    loss_and_grads(linear_cross_entropy, h, w, b, labels)
    assert ("liger_kernel" in sys.modules) == imported


def test_gradcheck_in_float64():
    h, w, b, labels = inputs(shape=(2, 4), hidden=3, vocab=5, dtype=torch.float64, ignored=2)
    leaves = [t.requires_grad_() for t in (h, w, b)]
    for num_items in (None, 3):

        def fn(h, w, b, num_items=num_items):
            return linear_cross_entropy(h, w, labels, bias=b, num_items_in_batch=num_items, chunk_size=3)

        assert torch.autograd.gradcheck(fn, leaves)


def test_no_tokens_x_vocab_tensor_is_saved_for_backward():
    """What autograd keeps between forward and backward (every tensor packed by saved_tensors_hooks): the chunked
    path keeps the three gradients (tokens x hidden, vocab x hidden, vocab); the plain path a tokens x vocab one."""
    tokens, hidden, vocab = 64, 8, 100

    def saved_numels(fn, **kwargs) -> list[int]:
        h, w, b, labels = inputs(shape=(1, tokens), hidden=hidden, vocab=vocab)
        numels = []

        def pack(tensor):
            numels.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = fn(h.requires_grad_(), w.requires_grad_(), labels, bias=b.requires_grad_(), **kwargs)
        loss.backward()
        return numels

    assert max(saved_numels(plain)) >= tokens * vocab  # the check can see a tokens x vocab tensor
    ours = saved_numels(linear_cross_entropy, chunk_size=16)
    assert sorted(ours) == sorted([tokens * hidden, vocab * hidden, vocab])


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    hidden=st.integers(1, 6),
    vocab=st.integers(1, 12),
    chunk_size=st.one_of(st.none(), st.integers(1, 40)),
    ignore_rate=st.sampled_from([0.0, 0.3, 1.0]),
    bias=st.booleans(),
    shift=st.booleans(),
    num_items=st.one_of(st.none(), st.integers(1, 30)),
    flat=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_equal_to_the_plain_path(
    batch, seq, hidden, vocab, chunk_size, ignore_rate, bias, shift, num_items, flat, seed
):
    g = torch.Generator().manual_seed(seed)
    shape = (seq,) if flat else (batch, seq)
    h = torch.randn(*shape, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g)
    b = torch.randn(vocab, generator=g) if bias else None
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignore_rate] = -100
    kwargs = {"num_items_in_batch": num_items}
    if shift:
        reference = loss_and_grads(plain, h, w, b, labels, scale=1.5, **kwargs)
    else:
        reference = loss_and_grads(plain, h, w, b, None, scale=1.5, shift_labels=labels, **kwargs)
    ours = loss_and_grads(
        linear_cross_entropy, h, w, b, labels, scale=1.5, shift=shift, chunk_size=chunk_size, **kwargs
    )
    # A gradient is a sum over the counted tokens of terms of about 1 / (their number) each: that is its scale.
    counted = int(((labels[..., 1:] if shift else labels) != -100).sum())
    assert_same(ours, reference, TOLERANCE[torch.float32], floor=1.0 / max(counted, 1))


def _bad(name: str):
    """Valid arguments with `name` replaced by a bad value."""
    h, w, b, labels = inputs(shape=(2, 3), hidden=4, vocab=6)
    good = {"hidden_states": h, "weight": w, "labels": labels, "bias": b}
    bad = {
        "hidden_states": [h[0, 0], h[None], h.long(), "h"],
        "weight": [w[:, :3], w[0], w.double(), w[:0]],
        "labels": [labels[:, :2], labels.float(), labels > 0],
        "bias": [b[:5], b.double()],
        "chunk_size": [0, -1, 2.0, True],
        "backend": ["triton"],
    }[name]
    return [{**good, name: value} for value in bad]


@pytest.mark.parametrize("name", ["hidden_states", "weight", "labels", "bias", "chunk_size", "backend"])
def test_bad_arguments_raise_one_line_naming_the_argument(name):
    for arguments in _bad(name):
        h, w, labels = (arguments.pop(k) for k in ("hidden_states", "weight", "labels"))
        with pytest.raises(ValueError, match=rf"^linear_cross_entropy: {name} [^\n]*$"):
            linear_cross_entropy(h, w, labels, **arguments)


def test_liger_backend_without_liger_kernel_or_cuda_is_one_line():
    h, w, b, labels = inputs()
    message = "needs Liger-Kernel" if importlib.util.find_spec("liger_kernel") is None else "needs CUDA tensors"
    with pytest.raises(ValueError, match=rf"^linear_cross_entropy: backend \"liger\" {message}[^\n]*$"):
        linear_cross_entropy(h, w, labels, backend="liger")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend",
    [
        "chunked",
        pytest.param(
            "liger",
            marks=pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel"),
        ),
    ],
)
def test_on_cuda_in_bf16_each_backend_equals_the_plain_path(backend):
    """On a GPU: the chunked backend and Liger's kernel against the plain path in bf16 (Liger rounds each chunk's
    logits as the plain path does, but its softmax and reductions are its own: bf16 tolerances for all)."""
    h, w, b, labels = (t.cuda() for t in inputs(shape=(4, 300), hidden=64, vocab=1000, dtype=torch.bfloat16))
    reference = loss_and_grads(plain, h, w, b, labels)
    ours = loss_and_grads(linear_cross_entropy, h, w, b, labels, backend=backend, chunk_size=128)
    tolerance = {"loss": 1e-5, "hidden": 2**-7, "weight": 2**-7, "bias": 2**-7}
    assert_same(ours, reference, tolerance if backend == "liger" else TOLERANCE[torch.bfloat16] | {"loss": 1e-5})
