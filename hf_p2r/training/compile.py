"""Regional compilation (trainer field `compile`): each decoder block's forward compiled by `torch.compile`, from
outside the model (the model file knows nothing of it).

Why per block: a pseudo model runs k blocks at L depths, and the blocks of one class and shape are the same code.
Dynamo keeps compiled code on the code object, with guards on what the code reads (the block's class and structure,
its parameters' shapes, dtypes and `requires_grad`, grad mode, autocast), not on which block runs it: one graph serves
a shared block at every depth, every block of a real model, and the blocks a delink makes. The training forwards pass
`use_cache=False`: a KV cache's update takes the depth as its slot, which would specialise the graph on the depth
(a recompilation per depth, and an error at torch's recompile limit of 8 under `fullgraph=True`).

What is compiled is the forward the block's class defines, with `fullgraph=True` (a graph break is an error, not a
silent split); `nn.Module.__call__` still runs the block's hooks around it, eagerly: granular offload's fetch and
release (`offload.py`), FSDP2's all-gather and reshard and `gather_shared_once`'s switch, transformers' hidden-state
capture. Activation checkpointing stays outside the compiled code too: the compiled forward is what
`torch.utils.checkpoint` runs and recomputes (transformers' checkpointing wrapper is left out of what dynamo traces,
`hf_p2r.compat.forward_without_checkpointing`), because an MoE block's router records its logits by a hook inside the
block, a side effect dynamo refuses inside its checkpoint operator. The forward is looked up on the block's class at
every call, so FSDP2's `fully_shard`, which gives each block a subclass, may come before or after `compile_blocks`
(torchtitan compiles, then shards); a delink's new blocks get the compiled forward from `compile_blocks` again (the
engines call it after each delink) and reuse the graph already compiled.

```python
>>> compile_blocks(model)                                     # inductor; or backend="aot_eager" to debug
>>> model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
```
"""

import functools
from collections.abc import Callable
from types import FunctionType, MethodType

import torch
from torch import nn

from ..compat import active_output_collector, forward_without_checkpointing, output_capture_for_compiled_code
from ..config import ConfigError

__all__ = ["check_backend", "compile_blocks"]


def check_backend(backend: str) -> None:
    """`ConfigError` naming `compile_backend` unless `backend` is one of torch.compile's registered backends (checked
    when the run starts: the list is torch's, which the configuration's parser does not import)."""
    if backend not in torch.compiler.list_backends(exclude_tags=()):  # debugging backends (aot_eager, eager) included
        known = ", ".join(["aot_eager", "eager", *torch.compiler.list_backends()])
        raise ConfigError(f"compile_backend: {backend!r} is not a torch.compile backend ({known})")


def compile_blocks(model: nn.Module, backend: str | Callable = "inductor") -> nn.Module:
    """Compile the forward of every decoder block of `model` (`model.base_model.layers`), in place; returns `model`.

    Each block's `forward` becomes an instance attribute that runs its class's `forward` compiled by
    `torch.compile(fullgraph=True, backend=backend)`: one compiled function per backend and set of parameter dtypes,
    shared by every block (a graph per block class, grad mode and autocast state). Calling it again (after a delink)
    is harmless.
    """
    for block in model.base_model.layers:
        block.forward = MethodType(functools.partial(_compiled_forward, backend), block)
    return model


def _compiled_forward(backend, block: nn.Module, *args, **kwargs):
    forward = forward_without_checkpointing(type(block))
    # One compiled function per set of dtypes the block's parameters hold now: granular offload swaps an offloaded
    # block's parameters to working copies in the autocast dtype and back, on the same Parameter objects, and torch
    # 2.11 does not guard on their dtype (a graph traced on bf16 copies ran on fp32 weights: "expected m1 and m2 to have
    # the same dtype"); 2.13 does, and compiles the same graphs either way.
    compiled = _compiled(backend, tuple(sorted({str(p.dtype) for p in block.parameters()})))
    outer = active_output_collector()  # read eagerly, before the compiled code runs
    calls = 0

    def run(*args):
        nonlocal calls
        calls += 1  # a second call is the checkpoint's recompute: what it records was recorded by the first
        with output_capture_for_compiled_code(outer, keep=calls == 1):
            return compiled(forward, block, *args, **kwargs)

    if not torch.is_grad_enabled():
        # Without grad, whether an input requires it changes nothing, but dynamo guards on it: the embeddings' output
        # does under activation checkpointing (transformers' `enable_input_require_grads`), the next depths' do not.
        args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)
    elif getattr(block, "gradient_checkpointing", False) and block.training and forward is not type(block).forward:
        # (Only where transformers checkpoints inside `forward`, which is what was left out of the compiled code.)
        # As transformers' wrapper does: a recomputed block must not write a cache a second time.
        kwargs.update(use_cache=False, **{name: None for name in ("cache", "past_key_values") if name in kwargs})
        return block._gradient_checkpointing_func(run, *args)
    return run(*args)


def _run(forward: Callable, block: nn.Module, *args, **kwargs):
    return forward(block, *args, **kwargs)


@functools.cache
def _compiled(backend: str | Callable, dtypes: tuple[str, ...]) -> Callable:
    """`_run` compiled, on a code object of its own for `dtypes` (dynamo keeps its graphs and guards per code object),
    shared by every block class (dynamo guards on the forward it is given)."""
    name = "_run_" + "_".join(dtype.removeprefix("torch.") for dtype in dtypes)
    code = _run.__code__.replace(co_name=name, co_qualname=name)
    return torch.compile(FunctionType(code, _run.__globals__, name), fullgraph=True, backend=backend)
