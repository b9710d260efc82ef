"""The delink of a pipelined P2R model, in each process on its own stages: the structure only. It returns which new
parameter starts as which old one, and the optimizer follows by the trainer's one carry
(`hf_p2r.training.carry`), as it does for a whole model.
"""

import copy

import torch
from torch import nn

from ...compat import local_tensor
from ...models.p2r import delink_sources
from .runtime import Pipeline, make_schedule, pipeline_model_config, stage_class
from .stage import P2RPipelineStage, model_name, shard_stage


def delink_stages(pipeline: Pipeline, num_unique_layers: int | None = None) -> dict[str, str]:
    """Delink this process's stages in place to `num_unique_layers` blocks (None: every depth its own block, the real
    model; fewer: a partial delink, e.g. 1 -> 2 -> 4, valid as for `P2RPreTrainedModel.delink`) and return
    {new model name: old model name} for the parameters, to carry optimizer state. Call it on every process of every
    pipeline at the same step, between optimizer steps, then give the pipeline an optimizer over its new parameters.

    The schedule is drained first, and a weight version it keeps beside the module's (2BW) is delinked alike. A new
    block starts as the block its depths ran: the first new block of an old one on this process keeps the block
    itself, the others get copies (as `P2RPreTrainedModel.delink`, per process). After a full delink a cycle replica is
    this stage's own real blocks, and with no parameter left on two processes the gradient reduction stops; after a
    partial one the replica groups are recomputed for the new blocks.
    """
    config = pipeline.config
    if not config.share_layers:
        raise ValueError("this pipelined model is already real (share_layers=False): there is nothing to delink")
    pipeline.drain()
    depth = config.num_hidden_layers
    target = depth if num_unique_layers is None else num_unique_layers
    sources = delink_sources(depth, config.num_unique_layers, target, config.sharing_pattern)
    new_config = copy.deepcopy(config)
    new_config.share_layers, new_config.num_unique_layers = target < depth, target
    # The schedule's weight versions are its (first) stage module's, under the stage's names.
    stage_name_before = {pipeline.name_of(name): name for name, _ in pipeline.modules[0].named_parameters()}
    if pipeline.sharded:
        mapping = _delink_sharded(pipeline, new_config, sources)
    else:
        mapping = _delink_replicated(pipeline, new_config, sources)
    pipeline.schedule.delinked(
        {name: stage_name_before[mapping[pipeline.name_of(name)]] for name, _ in pipeline.modules[0].named_parameters()}
    )
    return mapping


def _delink_replicated(pipeline: Pipeline, new_config, sources: list[int]) -> dict[str, str]:
    """`delink_stages` in place: each stage module's blocks replaced by the new ones."""
    order = new_config.block_of_depth
    taken: set[int] = set()  # old blocks whose module a new block already kept
    made: dict[int, nn.Module] = {}  # new block -> module, shared by this process's stages
    mapping: dict[str, str] = {}
    for module in pipeline.modules:
        layers = {}
        for index in dict.fromkeys(order[d] for d in module.depths):
            if index not in made:
                block = module.layers[str(sources[index])]
                if sources[index] in taken:
                    block = copy.deepcopy(block, {id(block.self_attn.config): block.self_attn.config})
                taken.add(sources[index])
                block.self_attn.layer_idx = index
                made[index] = block
            layers[str(index)] = made[index]
            for name, _ in made[index].named_parameters():
                mapping[f"model.layers.{index}.{name}"] = f"model.layers.{sources[index]}.{name}"
        module.layers = nn.ModuleDict(layers)
    for name, _ in pipeline.named_parameters():
        mapping.setdefault(name, name)
    config = pipeline.config
    config.share_layers, config.num_unique_layers = new_config.share_layers, new_config.num_unique_layers
    pipeline.refresh()
    return mapping


def _delink_sharded(pipeline: Pipeline, new_config, sources: list[int]) -> dict[str, str]:
    """`delink_stages` for FSDP2-sharded stages, without gathering a weight (as `delink_fully_sharded`): new stage
    modules with the new blocks are built on the meta device, sharded over the same column, and filled shard by
    shard (a new block is a copy of the block its depths ran: equal shapes shard equally); then new stages
    (`stage_class`) and a new schedule drive them."""
    whole = pipeline_model_config(pipeline)
    whole.share_layers, whole.num_unique_layers = new_config.share_layers, new_config.num_unique_layers
    with torch.device("meta"):
        skeleton = pipeline.model_class(whole)
    tied = whole.tie_word_embeddings
    mapping: dict[str, str] = {}
    modules, stages = [], []
    for old, old_stage in zip(pipeline.modules, pipeline.stages, strict=True):
        new = P2RPipelineStage(skeleton, old.depths, old.embed_tokens is not None, old.lm_head is not None, new_config)
        shard_stage(new, pipeline.data_mesh, skeleton)
        new.to_empty(device=local_tensor(next(old.parameters())).device)
        olds = dict(old.named_parameters())
        with torch.no_grad():
            for name, param in new.named_parameters():
                source = name
                if name.startswith("layers."):
                    index, rest = name.split(".", 2)[1:]
                    source = f"layers.{sources[int(index)]}.{rest}"
                local_tensor(param).copy_(local_tensor(olds[source]))
                mapping[model_name(name, tied)] = model_name(source, tied)
        for name, buffer in old.named_buffers():  # the rotary tables
            if not name.startswith("layers."):
                owner, _, leaf = name.rpartition(".")
                setattr(new.get_submodule(owner), leaf, buffer.detach().clone())
        new.train(old.training)
        modules.append(new)
        stages.append(
            stage_class(pipeline.spec, True)(
                new, old_stage.stage_index, old_stage.num_stages, old_stage.device, group=pipeline.group
            )
        )
    pipeline.modules, pipeline.stages = modules, stages
    pipeline.schedule = make_schedule(pipeline)
    pipeline.config = new_config  # the new stages' layout
    pipeline.refresh()
    return mapping


__all__ = ["delink_stages"]
