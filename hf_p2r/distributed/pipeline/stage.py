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
from torch.distributed.fsdp import fully_shard
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

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


def shard_stage(module: P2RPipelineStage, mesh: DeviceMesh, whole: P2RForCausalLM | None = None) -> P2RPipelineStage:
    """FSDP2 on a stage, in place: one unit per block it holds (a shared block is one unit, run at several depths),
    then the stage itself (embeddings, final norm, head), as `fully_shard_p2r` does for a whole model. `whole`: the
    model whose blocks the stage holds, when the stage is all of it (no pipeline: run by FSDP2's own hooks, not torch's
    `PipelineStage`): its shared blocks then stay gathered over the step, one all-gather each per step instead of two
    per depth (`gather_shared_once`, as the Accelerate engine's FSDP2 does)."""
    for block in module.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    if whole is not None:
        gather_shared_once(whole)
    return module


__all__ = ["P2RPipelineStage", "causal_lm_loss", "check_shardable", "model_name", "shard_stage"]
