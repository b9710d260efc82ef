"""A pipeline stage of a P2R model: the module that runs a contiguous range of depths, built from the model (the model
file knows nothing about pipelines, like transformers' own models: its `_pp_plan` only names the head), the names of
its parameters in the model, the loss its last stage computes, and FSDP2 on a stage.

transformers' `apply_pipeline_parallelism` replaces the layers a process does not own by `PipelineIdentityLayer` and
runs the whole forward on every process, one after the other, with no micro-batches: nothing of it is reused here but
the idea of keeping a contiguous range of depths per stage.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

from ...compat import pipeline_stage_backward
from ...models.p2r import P2RForCausalLM
from ...models.p2r.modeling_p2r import CACHE_KWARG
from ..fsdp import gather_shared_once


class P2RPipelineStage(nn.Module):
    """The part of a `P2RForCausalLM` that runs depths `depths`: the embeddings if `first`, the blocks those depths
    run (a pseudo model's shared blocks once each), the final norm and head if `last`.

    It holds the model's own modules (no copy); its parameter names are the model's with the `model.` prefix dropped
    (`model_name` maps them back). `forward` takes input ids on the first stage, hidden states elsewhere, and returns
    hidden states, or logits on the last stage. Training only: no cache, no padding mask (full blocks of tokens).
    """

    def __init__(self, model: P2RForCausalLM, depths: range, first: bool, last: bool, config=None):
        super().__init__()
        self.config = config if config is not None else model.config
        self.depths = list(depths)
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        blocks = sorted({self.config.block_of_depth[depth] for depth in self.depths})
        self.layers = nn.ModuleDict({str(block): base.layers[block] for block in blocks})
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = base.rotary_emb

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(hidden_states)
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=None,
            position_ids=position_ids,
            **{CACHE_KWARG: None},
        )
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        order = self.config.block_of_depth
        for depth in self.depths:
            hidden_states = self.layers[str(order[depth])](
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                layer_idx=depth,
            )
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden_states))
        return hidden_states

    def replica_keys(self) -> dict[str, list[str]]:
        """{replication key: parameter names}: a block's key is `layers.<block>`; a head tied to the embeddings shares
        the embeddings' key. Pieces with the same key on several processes are replicas of one parameter."""
        keys: dict[str, list[str]] = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
            if key == "lm_head" and self.config.tie_word_embeddings:
                key = "embed_tokens"
            keys.setdefault(key, []).append(name)
        return keys


class ShardedPipelineStage(PipelineStage):
    """torch's `PipelineStage` over an FSDP2-sharded stage whose every micro-batch's backward is FSDP2's own: each unit
    reshards after its backward and reduce-scatters its gradient into the sharded one (gradient accumulation on the
    shards), as `loss.backward()` on the module does. The stage's root unit (embeddings, final norm, head) is FSDP2's
    root: gathered from its forward to its backward.

    torch's stage runs each micro-batch's backward with the unit's reshard and gradient sync off
    (`set_reshard_after_backward(False)`, `set_requires_gradient_sync(False)`) and reduce-scatters once after the
    step's last backward: one reduce-scatter per step, but every block of the stage gathered and its gradients whole
    (8 bytes per parameter of the stage) from the first backward to the last. Here a process holds, beyond its
    shards, the block or two FSDP2 is gathering: one reduce-scatter per micro-batch instead. The step's end
    (`perform_reduce_grad`) finds nothing left to reduce, but on torch 2.15 a first stage's root: that torch's stage
    finalizes FSDP2's backward by hand, and the root of a stage whose inputs need no gradient (input ids) is
    reduce-scattered and resharded only then. Backwards split in two (zero bubble's input and weight halves) keep
    torch's way."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = pipeline_stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def model_name(stage_name: str, tied: bool = False) -> str:
    """A `P2RPipelineStage` parameter name -> the `P2RForCausalLM` one (`tied`: a head tied to the embeddings goes by
    the embeddings' name, as in the model's `named_parameters()` and checkpoints)."""
    if stage_name.startswith("lm_head."):
        return "model.embed_tokens.weight" if tied and stage_name == "lm_head.weight" else stage_name
    return f"model.{stage_name}"


def causal_lm_loss(vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the last stage computes per micro-batch: transformers' causal LM loss (shifted labels, token mean),
    what `P2RForCausalLM(input_ids, labels=input_ids).loss` computes."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    return loss_fn


def check_shardable(modules: list[P2RPipelineStage]) -> None:
    """FSDP2 makes each stage a root unit: a parameter held by two virtual stages of one process (a cycle block, a
    tied head) would belong to two roots. ValueError naming the field."""
    owner: dict[int, int] = {}
    for index, module in enumerate(modules):
        for name, param in module.named_parameters():
            if owner.setdefault(id(param), index) != index:
                raise ValueError(
                    f"data_parallel_shard: {model_name(name)} runs in two virtual stages of one process (a shared "
                    "block or a tied head under an interleaved schedule), which FSDP2 cannot shard; use 1f1b or gpipe"
                )


def shard_stage(module: P2RPipelineStage, mesh: DeviceMesh, model: P2RForCausalLM) -> P2RPipelineStage:
    """FSDP2 on a stage, in place: one unit per block it holds (a shared block is one unit, run at several depths),
    then the stage itself (embeddings, final norm, head), as `fully_shard_p2r` does for a whole model. `model`: the
    model whose blocks the stage holds; a block the stage runs at several depths stays gathered over a micro-batch's
    uses, one all-gather per micro-batch instead of two per depth (`gather_shared_once` over the stage's depths, as
    the Accelerate engine's FSDP2 does for a whole model)."""
    for block in module.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    gather_shared_once(model, module.depths)
    return module


__all__ = ["P2RPipelineStage", "ShardedPipelineStage", "causal_lm_loss", "check_shardable", "model_name", "shard_stage"]
