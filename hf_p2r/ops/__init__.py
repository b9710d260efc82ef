"""Compute kernels in plain torch that a model or a training engine may call (the models' layer: nothing of hf_p2r
above `errors`/`compat` is imported here).

- `linear_cross_entropy`: the causal-LM loss from the last hidden states and the head's weight, computed a chunk of
  tokens at a time so that full-vocabulary logits never exist (or Liger-Kernel's fused kernel on CUDA); `HeadLoss`, the
  same as a model's `loss_from_hidden_states`.
"""

from .linear_cross_entropy import HeadLoss, linear_cross_entropy

__all__ = ["HeadLoss", "linear_cross_entropy"]
