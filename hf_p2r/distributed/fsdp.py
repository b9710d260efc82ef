"""FSDP2 for P2R models: every stored block is one FSDP unit (a pseudo model's shared block is one unit called at
several depths), and `delink` of a sharded model without gathering it, depth growth included.

torch's `fully_shard` (FSDP2) supports a module that runs several times per step (torch tests it in
`test_multi_forward_module`, `test/distributed/_composable/fsdp/test_fully_shard_training.py`): each call all-gathers
in its pre-forward hook and, with the default `reshard_after_forward=True`, reshards after it and all-gathers again in
the backward. The gradient is reduce-scattered once, because autograd sums a leaf's gradient over all its uses before
writing `.grad`. So a pseudo block used at n = L/k depths costs 2n all-gathers per step. `gather_shared_once` keeps a
shared block unsharded from its first use in the forward to its last use in the backward: one all-gather and one
reduce-scatter per step, so the pseudo stage moves k blocks per step, not L, for k extra unsharded blocks in memory.

Under Accelerate (`fsdp_version: 2`, `fsdp_transformer_layer_cls_to_wrap: P2RDecoderLayer`) the stored blocks are
the units already; call `gather_shared_once(model)` after `accelerator.prepare` to get the schedule above. Accelerate
turns FSDP on only for accelerators: on CPU the plugin is ignored, which is why the CPU tests call `fully_shard_p2r`
(and Accelerate's `fsdp2_prepare_model`) directly.

DeepSpeed ZeRO-3 is `hf_p2r.distributed.deepspeed`.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..compat import local_tensor, reshard_after_backward
from ..models.p2r import DelinkPlan, P2RPreTrainedModel
from .materialize import copy_buffers, delinked_config


def fully_shard_p2r(
    model: P2RPreTrainedModel,
    *,
    mesh=None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    shared_gather_once: bool = True,
) -> P2RPreTrainedModel:
    """Apply FSDP2 in place: one unit per stored block, then the root unit (embeddings, final norm, head).

    A block is never split across units, so a shared block's parameters belong to exactly one FSDP group (FSDP2
    refuses a parameter seen by two groups). With `shared_gather_once` (the default) shared blocks follow the
    schedule of `gather_shared_once`; real blocks reshard after forward as `reshard_after_forward` says.

    ```python
    >>> mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world_size,))
    >>> fully_shard_p2r(model, mesh=mesh)
    >>> optimizer = torch.optim.AdamW(model.parameters())   # over the sharded (DTensor) parameters
    ```
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in model.base_model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    if shared_gather_once:
        gather_shared_once(model)
    return model


def gather_shared_once(model: P2RPreTrainedModel, depths: Iterable[int] | None = None) -> P2RPreTrainedModel:
    """Make every shared block of an FSDP2-sharded pseudo model all-gather once per step instead of twice per depth
    that runs it. Returns the model; real blocks are left as they are.

    The block stays unsharded (one full copy per rank, like FSDP's root unit) from its first use in the forward to
    its last use in the backward (the first depth), where it reshards as usual. Like the root unit, it stays
    unsharded after a forward without backward (evaluation) until the next backward. Call it after
    `fully_shard_p2r(..., shared_gather_once=False)` or after `accelerator.prepare`; calling it twice is harmless.
    `depths`: the depths this process runs (a pipeline stage's; default all): a block is shared if two of them run
    it, and the first of them is its last use in the backward; blocks no depth of them runs are left alone.
    """
    config = model.config
    first_depth: dict[int, int] = {}
    uses: dict[int, int] = {}
    for depth in range(len(config.block_of_depth)) if depths is None else sorted(depths):
        block = config.block_of_depth[depth]
        first_depth.setdefault(block, depth)
        uses[block] = uses.get(block, 0) + 1
    for index, block in enumerate(model.base_model.layers):
        if uses.get(index, 0) < 2 or getattr(block, "_p2r_gather_once", False):
            continue
        if not isinstance(block, FSDPModule):
            raise ValueError(
                f"model.layers.{index} is not an FSDP2 unit: shard each stored block with fully_shard first "
                "(fully_shard_p2r, or Accelerate with fsdp_transformer_layer_cls_to_wrap: P2RDecoderLayer)"
            )
        block.set_reshard_after_forward(False, recurse=False)
        block.register_forward_hook(_SyncOnLastUse(block, first_depth[index]), with_kwargs=True)
        block._p2r_gather_once = True
    return model


class _SyncOnLastUse:
    """Forward hook of a shared block: tags each use's output so that, in the backward, every use but the last one
    (the first depth) leaves the block unsharded for the next."""

    def __init__(self, block: FSDPModule, first_depth: int):
        self.block = block
        self.first_depth = first_depth
        self.user_setting: bool | None = None

    def __call__(self, module: nn.Module, args, kwargs, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return output
        depth = kwargs.get("layer_idx")
        if depth is None:
            raise ValueError("a shared P2R block was called without layer_idx: gather_shared_once needs the depth")
        return _BackwardSwitch.apply(self, depth == self.first_depth, output)

    def switch(self, last_use: bool) -> None:
        # FSDP2 reads the flag in the post-backward hook of this use, which runs after this switch. The user's value
        # (`set_reshard_after_backward` has no public getter: see hf_p2r.compat) is restored for the last use.
        if not last_use:
            if self.user_setting is None:
                self.user_setting = reshard_after_backward(self.block)
            self.block.set_reshard_after_backward(False, recurse=False)
        elif self.user_setting is not None:
            self.block.set_reshard_after_backward(self.user_setting, recurse=False)
            self.user_setting = None


class _BackwardSwitch(torch.autograd.Function):
    """Identity in the forward; in the backward, before the block's own backward, sets how FSDP ends this use."""

    @staticmethod
    def forward(ctx, hook: _SyncOnLastUse, last_use: bool, output: torch.Tensor) -> torch.Tensor:
        ctx.hook, ctx.last_use = hook, last_use
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hook.switch(ctx.last_use)
        return None, None, grad


def delink_fully_sharded(
    model: P2RPreTrainedModel,
    num_unique_layers: int | DelinkPlan | None = None,
    *,
    shard: Callable[[nn.Module], nn.Module],
) -> tuple[P2RPreTrainedModel, dict[str, str]]:
    """Delink an FSDP2-sharded P2R model without gathering it; returns `(new_model, parameter_map)`.

    The delink is `model.delink`'s: `num_unique_layers` blocks (None: the real model) or a `DelinkPlan`
    (`model.delink_plan(k, num_hidden_layers=L', growth=..., function_preserving=...)`), depth growth included.

    `delink` cannot run in place on a sharded model (it deep-copies blocks, and FSDP2's state would be copied with
    them). Instead a new model with the config after the delink (`plan.fields`) is built on the meta device, sharded by
    `shard` (e.g. `functools.partial(fully_shard_p2r, mesh=mesh)`: the same layout as the old model), allocated, and
    filled rank by rank: a new block (of a grown model too) is a copy of an old block of the same shapes, and FSDP2
    shards equal shapes equally on the same mesh, so each rank's shard of the new block is its shard of the old one,
    started as the plan says (`DelinkPlan.start_copy`: function-preserving growth's zeroed and scaled residual
    outputs, elementwise on the shard). No parameter is ever gathered.

    `parameter_map` is `{new parameter name: old parameter name}` (`delink_parameter_map`), for carrying optimizer
    state: the optimizer state tensors are DTensors laid out like their parameters, so they carry shard by shard too.
    The caller drops the old model and optimizer afterwards. Buffers (rotary tables) are copied from the old model.
    """
    plan = model.delink_plan(num_unique_layers)
    parameter_map = model.delink_parameter_map(plan)
    for unit in model.modules():  # a forward without backward (an evaluation) leaves the root unit gathered
        if isinstance(unit, FSDPModule):
            unit.reshard()
    old_parameters = dict(model.named_parameters())
    dtypes = {parameter.dtype for parameter in old_parameters.values()}
    if len(dtypes) != 1:
        raise ValueError(f"delink_fully_sharded needs one parameter dtype, the model has {sorted(map(str, dtypes))}")

    model_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    with torch.device("meta"):
        new_model = model_class(delinked_config(model.config, plan)).to(dtypes.pop())
    new_model = shard(new_model)

    first = next(iter(old_parameters.values()))
    new_model.to_empty(device=local_tensor(first).device)
    with torch.no_grad():
        for name, parameter in new_model.named_parameters():
            source = old_parameters[parameter_map[name]]
            if getattr(parameter, "placements", None) != getattr(source, "placements", None) or (
                local_tensor(parameter).shape != local_tensor(source).shape
            ):
                raise ValueError(
                    f"{name}: the new model is not sharded like the old one ({_layout(parameter)} vs "
                    f"{_layout(source)}); pass a `shard` that applies the old model's FSDP layout"
                )
            plan.start_copy(name, local_tensor(parameter).copy_(local_tensor(source)))
            parameter.requires_grad_(source.requires_grad)
    copy_buffers(model, new_model, plan.sources)
    new_model.train(model.training)
    return new_model, parameter_map


def _layout(tensor: torch.Tensor) -> str:
    placements = getattr(tensor, "placements", None)
    return f"placements={placements}, local shape={tuple(local_tensor(tensor).shape)}"


__all__ = ["delink_fully_sharded", "fully_shard_p2r", "gather_shared_once"]
