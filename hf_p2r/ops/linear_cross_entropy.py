"""The causal-LM loss from the last hidden states and the output head, without full-vocabulary logits.

`F.linear` followed by transformers' `ForCausalLMLoss` holds tokens x vocab logits in the model's dtype, their fp32
upcast, log-softmax's fp32 output (saved for backward) and, in backward, fp32 tokens x vocab gradients: about 12 bytes
per logit in bf16, 24 GiB at 16k tokens and a 128k vocabulary. `linear_cross_entropy` computes the same loss a chunk
of tokens at a time and, in the same pass, the chunk's gradients with respect to the hidden states, the weight and
the bias (the approach of Liger's fused linear cross-entropy): only those gradients are saved for backward, which
scales them by the incoming gradient. Memory above the inputs is the gradients, the weight's gradient summed in fp32
and one chunk's logits: with the default chunk (the hidden size) a few times vocab x hidden x 4 bytes, whatever the
number of tokens (benchmarks/loss_memory.md).

Semantics are those of transformers' `ForCausalLMLoss` (transformers/loss/loss_utils.py): labels shifted left by one
(the last position gets `ignore_index`), `ignore_index` tokens left out, the mean over the remaining tokens, or the
sum divided by `num_items_in_batch` when given (gradient accumulation over micro-batches); logits computed in the
matmul dtype, then upcast to fp32 for the softmax. A batch where every token is ignored has loss NaN under the mean
(0 / 0, as `F.cross_entropy` gives) and zero gradients; with `num_items_in_batch` its loss is 0.

How the trainer calls it (trainer field `loss_kernel`): through the model's forward, with `HeadLoss` as the model's
`loss_from_hidden_states` (P2RForCausalLM's hook), so that DDP's and FSDP2's root hooks run around it and, under FSDP2
(`fully_shard_p2r` puts the embeddings, the final norm and the head in the root unit) or ZeRO-3, the head's weight is
whole where it is read:

```python
>>> model.loss_from_hidden_states = HeadLoss("auto")
>>> loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss  # == the plain loss; logits: None
```

Tensor parallelism that splits the head over the vocabulary needs a vocabulary-parallel loss, which this is not.

Backends: `"chunked"` (pure torch, any device), `"liger"` (Liger-Kernel's fused Triton kernel, CUDA tensors, needs
`pip install liger-kernel`), `"auto"` (Liger when it is installed and the tensors are on CUDA, chunked otherwise).
"""

import functools
import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["HeadLoss", "linear_cross_entropy"]

BACKENDS = ("auto", "chunked", "liger")

Backend = Literal["auto", "chunked", "liger"]


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Transformers' causal-LM loss of `F.linear(hidden_states, weight, bias)` against `labels`, computed without
    holding the logits of more than `chunk_size` tokens.

    Args:
        hidden_states: `(batch, seq, hidden)` or `(seq, hidden)` (one sequence), floating point, any strides.
        weight: the head's `(vocab, hidden)` weight, of `hidden_states`' dtype (under autocast, any floating dtype:
            both are cast to autocast's dtype, as `F.linear` would be). May be tied to the input embedding: its
            gradient adds to the embedding's.
        labels: integer tensor of `hidden_states.shape[:-1]`; moved to `hidden_states`' device. Values other than
            `ignore_index` must lie in `[0, vocab)` (not checked: that would synchronise with the GPU).
        bias: optional `(vocab,)` bias of `weight`'s dtype.
        num_items_in_batch: when given, the loss is the sum over the tokens divided by it (transformers' gradient
            accumulation); `1` gives the sum.
        ignore_index: label of tokens left out of the loss.
        shift: `True` (default): position t predicts `labels[..., t + 1]`, as `model(input_ids, labels=input_ids)`.
            `False`: `labels` are already the targets of each position (transformers' `shift_labels`; use it for
            packed or flattened sequences, where the shift must not cross a sequence boundary).
        chunk_size: tokens per chunk for the chunked backend. Default: the hidden size, so that a chunk's fp32
            logits take as many bytes as the fp32 sum of the weight's gradient (memory above the inputs stays a few
            times vocab x hidden x 4 bytes, whatever the token count), and each chunk's weight-gradient product
            (inner dimension: the chunk) runs at matmul speed rather than at memory speed.
        backend: `"auto"`, `"chunked"` or `"liger"` (see the module's docstring).

    Returns:
        The scalar loss in fp32 (fp64 for fp64 inputs). Gradients come back in each input's dtype; the chunked
        backend sums the weight's and the bias' gradients over chunks in fp32.

    Raises:
        ValueError: one line naming the argument, for a bad shape, dtype, `chunk_size` or `backend`, or `"liger"`
            where Liger-Kernel is not installed or the tensors are not on CUDA.
    """
    _check(hidden_states, weight, labels, bias, chunk_size, backend)
    labels = labels.to(hidden_states.device)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden_2d = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = labels.reshape(-1)

    device_type = hidden_states.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden_states.dtype
    # Liger is looked for only for CUDA tensors: importing it loads Triton.
    liger = _liger_function() if backend != "chunked" and hidden_states.is_cuda else None
    if backend == "liger" and liger is None:
        raise ValueError(
            'linear_cross_entropy: backend "liger": liger_kernel is installed but its '
            "liger_kernel.transformers.functional.liger_fused_linear_cross_entropy does not import"
        )
    if liger is not None:
        return _liger_loss(liger, hidden_2d, weight, targets, bias, num_items_in_batch, ignore_index, compute_dtype)

    chunk_size = chunk_size or weight.shape[1]
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden_2d, weight, bias)):
            return _ChunkedLinearCrossEntropy.apply(
                hidden_2d, weight, bias, targets, num_items_in_batch, ignore_index, chunk_size, compute_dtype
            )
        loss, _, _, _ = _chunked(
            hidden_2d, weight, bias, targets, num_items_in_batch, ignore_index, chunk_size, compute_dtype, (0, 0, 0)
        )
        return loss


class HeadLoss:
    """`linear_cross_entropy` as a model's `loss_from_hidden_states` (P2RForCausalLM's hook: called inside the
    model's forward, where FSDP2's root unit and ZeRO-3 hold the head's whole weight, with the head and the keyword
    arguments transformers' `loss_function` gets).

    ```python
    >>> model.loss_from_hidden_states = HeadLoss("chunked")
    >>> model(input_ids=ids, labels=ids).loss  # the same loss, no tokens x vocab logits (outputs.logits is None)
    ```
    """

    def __init__(self, backend: Backend = "auto", chunk_size: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"linear_cross_entropy: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend, self.chunk_size = backend, chunk_size

    def __call__(
        self, hidden_states, head, labels, *, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        shift = shift_labels is None  # transformers' `shift_labels`: targets already shifted (packed sequences)
        return linear_cross_entropy(
            hidden_states,
            head.weight,
            labels if shift else shift_labels,
            bias=head.bias,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            shift=shift,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )

    def __repr__(self) -> str:
        return f"HeadLoss({self.backend!r})"


def _check(hidden_states, weight, labels, bias, chunk_size, backend) -> None:
    def fail(message: str):
        raise ValueError(f"linear_cross_entropy: {message}")

    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        fail(f"hidden_states must be a floating-point tensor, got {_describe(hidden_states)}")
    if hidden_states.dim() not in (2, 3):
        fail(f"hidden_states must be (batch, seq, hidden) or (seq, hidden), got shape {tuple(hidden_states.shape)}")
    hidden = hidden_states.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden:
        fail(f"weight must be a (vocab, {hidden}) tensor for hidden size {hidden}, got {_describe(weight)}")
    if weight.shape[0] == 0:
        fail("weight must have at least one row (vocab >= 1), got shape (0, ...)")
    same_dtype = weight.dtype == hidden_states.dtype or torch.is_autocast_enabled(hidden_states.device.type)
    if not weight.is_floating_point() or not same_dtype:
        fail(f"weight must have hidden_states' dtype {hidden_states.dtype} outside autocast, got {weight.dtype}")
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        fail(f"labels must be an integer tensor, got {_describe(labels)}")
    if labels.shape != hidden_states.shape[:-1]:
        fail(
            f"labels must have hidden_states' shape without its last dim {tuple(hidden_states.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1] or bias.dtype != weight.dtype
    ):
        fail(f"bias must be a ({weight.shape[0]},) tensor of weight's dtype {weight.dtype}, got {_describe(bias)}")
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size < 1):
        fail(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if backend not in BACKENDS:
        fail(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "liger" and importlib.util.find_spec("liger_kernel") is None:
        fail('backend "liger" needs Liger-Kernel (pip install liger-kernel), which is not installed')
    if backend == "liger" and not hidden_states.is_cuda:
        fail(f'backend "liger" needs CUDA tensors, got hidden_states on {hidden_states.device}')


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _chunked(hidden, weight, bias, targets, num_items_in_batch, ignore_index, chunk_size, compute_dtype, needs):
    """(loss, grad of hidden, grad of weight, grad of bias) of the mean loss, a chunk of tokens at a time; a gradient
    is None where `needs` (three flags) says it is not wanted."""
    tokens = hidden.shape[0]
    # Sums over tokens (loss, weight and bias gradients) in fp32, fp64 for fp64 inputs (transformers' `.float()`
    # would narrow those: the one place this differs from it, so that gradcheck holds).
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    valid = targets != ignore_index
    if num_items_in_batch is None:
        divisor = valid.sum()
        # 0 / 0 tokens: the loss is NaN, as F.cross_entropy's mean; the gradients are zero, as its backward's.
        token_weight = valid.to(acc_dtype) / divisor.clamp(min=1)
    else:
        divisor = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        token_weight = valid.to(acc_dtype) / divisor
    safe_targets = torch.where(valid, targets, 0)

    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    grad_hidden = torch.empty(tokens, hidden.shape[1], dtype=compute_dtype, device=hidden.device) if needs[0] else None
    grad_weight = torch.zeros(w.shape, dtype=acc_dtype, device=w.device) if needs[1] else None
    grad_bias = torch.zeros(w.shape[0], dtype=acc_dtype, device=w.device) if needs[2] else None
    loss_sum = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    for start in range(0, tokens, chunk_size):
        end = min(start + chunk_size, tokens)
        h = hidden[start:end].to(compute_dtype)
        logits = F.linear(h, w, b).to(acc_dtype)  # (chunk, vocab): as the plain path, the matmul's dtype, then fp32
        target = safe_targets[start:end, None]
        target_logit = logits.gather(1, target).squeeze(1)
        # log-sum-exp as torch.logsumexp computes it (max + log sum exp(x - max)), in place: no second chunk.
        top = logits.amax(dim=-1, keepdim=True)
        total = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
        loss_sum += ((top + total.log()).squeeze(1) - target_logit).mul_(valid[start:end]).sum()
        if not any(needs):
            continue
        # d loss / d logits = (softmax - one_hot(target)) * token weight, written over the logits.
        logits.div_(total)
        logits.scatter_add_(1, target, torch.full(target.shape, -1.0, dtype=acc_dtype, device=target.device))
        logits.mul_(token_weight[start:end, None])
        if grad_bias is not None:
            grad_bias += logits.sum(0)
        grad_logits = logits.to(compute_dtype)  # the plain path's gradient enters its matmuls in their dtype
        del logits  # (an fp32 copy when the matmuls run in bf16/fp16: freed before the weight's product)
        if grad_hidden is not None:
            torch.mm(grad_logits, w, out=grad_hidden[start:end])
        if grad_weight is not None:
            if compute_dtype == acc_dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                # A matmul in bf16/fp16 (fp32 inside, rounded once per chunk) added to the fp32 sum, a block of
                # vocabulary rows at a time: the rounded product is never larger than the chunk's gradient.
                rows = max(1, grad_logits.numel() // w.shape[1])
                for row in range(0, w.shape[0], rows):
                    grad_weight[row : row + rows] += grad_logits[:, row : row + rows].t() @ h
    loss = loss_sum / divisor
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss, grad_hidden, grad_weight, grad_bias


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk and saves only the gradients; backward scales them
    by the incoming gradient. First-order only (no double backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, num_items_in_batch, ignore_index, chunk_size, compute_dtype):
        needs = ctx.needs_input_grad[:3]
        loss, grad_hidden, grad_weight, grad_bias = _chunked(
            hidden, weight, bias, targets, num_items_in_batch, ignore_index, chunk_size, compute_dtype, needs
        )
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grads = tuple(None if g is None else g * grad_output.to(g.dtype) for g in ctx.saved_tensors)
        return *grads, None, None, None, None, None


def _liger_loss(liger, hidden, weight, targets, bias, num_items_in_batch, ignore_index, compute_dtype):
    """Liger-Kernel's fused linear cross-entropy with the same reduction (it saves only the gradients too; its edge
    cases, e.g. a batch with every token ignored, are Liger's)."""
    with torch.autocast("cuda", enabled=False):
        loss = liger(
            hidden.to(compute_dtype).contiguous(),
            weight.to(compute_dtype),
            targets.contiguous(),
            bias=None if bias is None else bias.to(compute_dtype),
            ignore_index=ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
        )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss.float()


@functools.cache
def _liger_function():
    """Liger-Kernel's functional fused linear cross-entropy, or None where it is not installed (imported on first
    use only: importing it loads Triton)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy
