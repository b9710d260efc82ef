"""The delink of a pipelined P2R model, in each process on its own stages: the structure only. It returns which new
parameter starts as which old one, and the optimizer follows by the trainer's one carry
(`hf_p2r.training.carry`), as it does for a whole model. Depth growth included, where the stages can grow in place
(`split.grown_split`).
"""

import copy

import torch
from torch import nn

from ...compat import local_tensor
from ...models.p2r import DelinkPlan, plan_delink
from ..materialize import delinked_config
from .runtime import Pipeline, make_schedule, pipeline_model_config, stage_class
from .split import grown_split, stage_depths
from .stage import P2RPipelineStage, model_name, shard_stage


def delink_stages(pipeline: Pipeline, num_unique_layers: int | DelinkPlan | None = None) -> dict[str, str]:
    """Delink this process's stages in place to `num_unique_layers` blocks (None: every depth its own block, the real
    model; fewer: a partial delink, e.g. 1 -> 2 -> 4, valid as for `P2RPreTrainedModel.delink`; a `DelinkPlan`:
    `plan_delink(pipeline.config, k, num_hidden_layers=L', growth=..., function_preserving=...)`, depth growth
    included) and return {new model name: old model name} for the parameters, to carry optimizer state. Call it on
    every process of every pipeline at the same step, between optimizer steps, then give the pipeline an optimizer
    over its new parameters.

    The schedule is drained first, and a weight version it keeps beside the module's (2BW) is delinked alike. A new
    block starts as the block its depths ran: the first new block of an old one on this process keeps the block
    itself, the others get copies (as `P2RPreTrainedModel.delink`, per process), started as the plan says
    (`DelinkPlan.start_copy`: function-preserving growth's zeroed and scaled residual outputs). After a full delink a
    cycle replica is this stage's own real blocks, and with no parameter left on two processes the gradient reduction
    stops; after a partial one the replica groups are recomputed for the new blocks.

    Growth keeps every weight on its process: each stage runs the copies of its own layers (`grown_split`: any growth
    for the whole model as one stage, "interleave" for several stages; "stack" across stages is refused in one line
    before anything changes). A model that cannot grow there grows on one process or through the converter.
    """
    config = pipeline.config
    plan = num_unique_layers
    if not isinstance(plan, DelinkPlan):
        plan = plan_delink(config, num_unique_layers)
    elif plan.before != (config.num_hidden_layers, config.num_blocks):
        raise ValueError(
            f"a DelinkPlan for a model of {plan.before[0]} layers and {plan.before[1]} blocks, given alone, delinks "
            f"that model; this pipeline runs {config.num_hidden_layers} layers and {config.num_blocks} blocks"
        )
    split = grown_split(config, pipeline.split, plan)  # a growth the stages cannot do is refused here
    pipeline.drain()
    new_config = delinked_config(config, plan)
    depths = stage_depths(split)
    new_depths = [depths[stage.stage_index] for stage in pipeline.stages]
    # The schedule's weight versions are its (first) stage module's, under the stage's names.
    stage_name_before = {pipeline.name_of(name): name for name, _ in pipeline.modules[0].named_parameters()}
    if pipeline.sharded:
        mapping = _delink_sharded(pipeline, new_config, plan, new_depths)
    else:
        mapping = _delink_replicated(pipeline, plan, new_depths)
    for key, value in plan.fields.items():  # the blocks' own config (the replicated path's: Depth-µP's multiplier)
        setattr(pipeline.model_config, key, value)
    pipeline.split = split
    pipeline.refresh()
    pipeline.schedule.delinked(
        {
            name: stage_name_before[mapping[pipeline.name_of(name)]]
            for name, _ in pipeline.modules[0].named_parameters()
        },
        start=plan.start_copy,
    )
    return mapping


def _delink_replicated(pipeline: Pipeline, plan: DelinkPlan, new_depths: list[range]) -> dict[str, str]:
    """`delink_stages` in place: each stage module's blocks replaced by the new ones, and its depths by `new_depths`."""
    config = pipeline.config
    order = delinked_config(config, plan).block_of_depth
    sources = plan.sources
    taken: set[int] = set()  # old blocks whose module a new block already kept
    made: dict[int, nn.Module] = {}  # new block -> module, shared by this process's stages
    mapping: dict[str, str] = {}
    for module, depths in zip(pipeline.modules, new_depths, strict=True):
        layers = {}
        for index in dict.fromkeys(order[d] for d in depths):
            if index not in made:
                block = module.layers[str(sources[index])]
                if sources[index] in taken or index in plan.fresh:
                    block = copy.deepcopy(block, {id(block.self_attn.config): block.self_attn.config})
                else:
                    taken.add(sources[index])
                block.self_attn.layer_idx = index
                made[index] = block
            layers[str(index)] = made[index]
            for name, _ in made[index].named_parameters():
                mapping[f"model.layers.{index}.{name}"] = f"model.layers.{sources[index]}.{name}"
        module.layers = nn.ModuleDict(layers)
        module.depths = list(depths)
    with torch.no_grad():  # once every block is made: a copy is made from its source as it was
        for index, block in made.items():
            for name, param in block.named_parameters():
                plan.start_copy(f"layers.{index}.{name}", param)
    for name, _ in pipeline.named_parameters():
        mapping.setdefault(name, name)
    for key, value in plan.fields.items():  # in place: the stage modules hold this config
        setattr(config, key, value)
    return mapping


def _delink_sharded(pipeline: Pipeline, new_config, plan: DelinkPlan, new_depths: list[range]) -> dict[str, str]:
    """`delink_stages` for FSDP2-sharded stages, without gathering a weight (as `delink_fully_sharded`): new stage
    modules running `new_depths` with the new blocks are built on the meta device, sharded over the same column, and
    filled shard by shard (a new block is a copy of the block its depths ran: equal shapes shard equally, started as
    the plan says); then new stages (`stage_class`) and a new schedule drive them."""
    whole = delinked_config(pipeline_model_config(pipeline), plan)
    with torch.device("meta"):
        skeleton = pipeline.model_class(whole)
    tied = whole.tie_word_embeddings
    mapping: dict[str, str] = {}
    modules, stages = [], []
    for old, old_stage, depths in zip(pipeline.modules, pipeline.stages, new_depths, strict=True):
        new = P2RPipelineStage(skeleton, depths, old.embed_tokens is not None, old.lm_head is not None, new_config)
        shard_stage(new, pipeline.data_mesh, skeleton)
        new.to_empty(device=local_tensor(next(old.parameters())).device)
        olds = dict(old.named_parameters())
        with torch.no_grad():
            for name, param in new.named_parameters():
                source = name
                if name.startswith("layers."):
                    index, rest = name.split(".", 2)[1:]
                    source = f"layers.{plan.sources[int(index)]}.{rest}"
                plan.start_copy(name, local_tensor(param).copy_(local_tensor(olds[source])))
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
    return mapping


__all__ = ["delink_stages"]
