"""Every rule that compares fields, in one module: the one validator the trainer and the planner (`hf-p2r plan --config
run.yaml`) share, so both refuse the same configurations with the same line.

A rule is a function of the sections it names (`@rule("stages", "schedule")`); `check_run` runs them all on a
`TrainConfig` in the order below, which bounds the model's sizes (the model's own validators, `check_model`) before
any rule builds something that scales with them; `check_sections` runs those a `TrainArguments` holds the sections of.
A field's own checks (its type, its range) are declared with it (`hf_p2r.config.sections`). Plain Python (no torch, no
transformers).
"""

import types
from collections.abc import Callable, Mapping

from ..distributed.pipeline.schedules import get_schedule
from ..distributed.pipeline.split import check_split
from ..models.p2r.sharing_p2r import block_of_depth, delink_sources, plan_delink, validate_layout, validate_moe
from .fields import ConfigError, short
from .sections import LearningRateSchedule, even_delink_steps

# (rule, the sections it reads), in the order they run.
RULES: list[tuple[Callable, tuple[str, ...]]] = []


def rule(*sections: str) -> Callable:
    """Register a rule reading `sections` (`TrainConfig` attribute names): called as `rule(**those sections)`, or with
    the whole `config` where it names "config" (the derived schedule)."""

    def register(function: Callable) -> Callable:
        RULES.append((function, sections))
        return function

    return register


def check_run(config) -> None:
    """Every rule on `config` (a `TrainConfig`), the first broken one raised as one `ConfigError` naming the field."""
    parts = {**config.sections(), "config": config}
    for function, sections in RULES:
        function(**{name: parts[name] for name in sections})


def check_sections(parts: Mapping[str, object]) -> None:
    """The rules whose sections are all in `parts` ({section name: section}; not those of the whole config)."""
    for function, sections in RULES:
        if set(sections) <= parts.keys():
            function(**{name: parts[name] for name in sections})


# --- the data ---------------------------------------------------------------------------------------------------------
@rule("data")
def check_data_source(data) -> None:
    """One source; streaming needs one; held-out files are a streaming run's."""
    if data.dataset_name and data.train_files:
        raise ConfigError("train_files: give either dataset_name (Hub) or train_files (local), not both")
    if data.streaming and not (data.dataset_name or data.train_files):
        raise ConfigError("streaming: give dataset_name or train_files to stream (the built-in corpus is not)")
    if data.validation_files and not data.streaming:
        raise ConfigError(
            "validation_files: read by a streaming run only (streaming: true); a map-style run holds out "
            "validation_fraction of its blocks"
        )
    if data.streaming and data.train_files and not data.validation_files:
        raise ConfigError("validation_files: a streaming run of train_files needs held-out files to evaluate on")


# --- the model --------------------------------------------------------------------------------------------------------
@rule("model")
def check_heads(model) -> None:
    kv_heads = model.num_key_value_heads or model.num_attention_heads
    if model.num_attention_heads % kv_heads:
        raise ConfigError(
            f"num_key_value_heads: {kv_heads} must divide num_attention_heads ({model.num_attention_heads})"
        )


# --- the steps and the learning rate ----------------------------------------------------------------------------------
@rule("stages")
def check_length(stages) -> None:
    if stages.total_steps == 0:
        raise ConfigError("real_steps: pseudo_steps + real_steps must be at least 1")


@rule("optim", "schedule", "stages")
def check_learning_rate_schedule(optim, schedule, stages) -> None:
    """The warm-up, and wsd's decay, fit in the schedule's steps."""
    lr = LearningRateSchedule.of(optim, schedule, stages)
    if lr.warmup_steps > lr.schedule_steps:
        spans = "pseudo_steps + real_steps" if schedule.lr_schedule_steps is None else "lr_schedule_steps"
        raise ConfigError(
            f"warmup_steps: the warm-up ({lr.warmup_steps} steps) is longer than the run ({lr.schedule_steps} "
            f"step{'s' * (lr.schedule_steps != 1)}: {spans}); pass --warmup_steps {lr.schedule_steps} or less"
        )
    if lr.lr_scheduler == "wsd" and lr.warmup_steps + lr.decay_steps > lr.schedule_steps:
        raise ConfigError(
            f"lr_decay_fraction: warm-up ({lr.warmup_steps} steps) and decay ({lr.decay_steps}) must fit in the run "
            f"({lr.schedule_steps} steps), got {schedule.lr_decay_fraction}"
        )


# --- how it runs ------------------------------------------------------------------------------------------------------
@rule("offload", "compute")
def check_offload_budget(offload, compute) -> None:
    if compute.cpu:  # (otherwise the trainer checks once it knows the device)
        offload.check_offload_budget("cpu")


@rule("offload", "optim")
def check_offload_update(offload, optim) -> None:
    if offload.offload is not None and offload.offload_update == "during_backward" and optim.max_grad_norm:
        raise ConfigError(
            "offload_update: during_backward steps each offloaded block before the whole gradient's norm is known, "
            f"so it cannot clip (max_grad_norm is {optim.max_grad_norm:g}): set max_grad_norm 0, or offload_update "
            "delayed or after_backward"
        )


@rule("checkpointing")
def check_checkpoint_async(checkpointing) -> None:
    if checkpointing.checkpoint_async and checkpointing.checkpoint_format == "accelerate":
        raise ConfigError(
            "checkpoint_async: asynchronous saves write DCP checkpoints (checkpoint_format: dcp or auto), this run's "
            "checkpoint_format is accelerate"
        )


@rule("parallel", "offload", "compute")
def check_parallel_layout(parallel, offload, compute) -> None:
    """What the pipeline engine (stages, or the whole model one stage over data_parallel_size processes) runs."""
    if parallel.pipeline_delay_correction != "none" and (
        parallel.pipeline_parallel_size == 1 or parallel.pipeline_schedule != "2bw"
    ):
        raise ConfigError(
            "pipeline_delay_correction: corrects PipeDream-2BW's one-step delay (pipeline_schedule: 2bw with "
            f"pipeline_parallel_size > 1); this run has {parallel.pipeline_schedule} "
            f"x{parallel.pipeline_parallel_size}, whose updates are not delayed"
        )
    if parallel.data_parallel_shard and parallel.data_parallel_size == 1:
        raise ConfigError(
            "data_parallel_shard: shards over data_parallel_size > 1 processes (or pipelines), got 1; with "
            "accelerate launch, FSDP2 is the launcher's config (configs/accelerate/fsdp2.yaml)"
        )
    if parallel.pipeline_parallel_size == 1 and parallel.data_parallel_size == 1:
        return
    schedule = get_schedule(parallel.pipeline_schedule)  # what it allows: the schedule registry
    try:
        schedule.check_one_stage(parallel.pipeline_parallel_size)
        if parallel.data_parallel_shard:
            schedule.check_shardable()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    engine = "pipeline_parallel_size > 1" if parallel.pipeline_parallel_size > 1 else "data_parallel_size > 1"
    refused = [
        ("offload", offload.offload is not None, "granular offload runs in one process"),
        ("gradient_accumulation_steps", compute.gradient_accumulation_steps != 1, "num_microbatches splits the batch"),
        ("mixed_precision", compute.mixed_precision not in (None, "no"), "stages run in fp32 so far"),
        ("compile", compute.compile, "stages run eagerly so far"),
        ("loss_kernel", compute.loss_kernel != "plain", "the last stage computes the plain loss so far"),
    ]
    for name, bad, why in refused:
        if bad:
            raise ConfigError(f"{name}: not supported with {engine} ({why})")
    microbatches = parallel.num_microbatches or parallel.pipeline_parallel_size
    if compute.per_device_batch_size % microbatches:
        raise ConfigError(
            f"num_microbatches: {microbatches} must divide per_device_batch_size ({compute.per_device_batch_size}), "
            "the pipeline's batch"
        )
    try:
        schedule.check_microbatches(microbatches, parallel.pipeline_parallel_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None


# --- rules over the whole run (its derived delink schedule, its first model) ------------------------------------------
@rule("config")
def check_model(config) -> types.SimpleNamespace:
    """The model's shape by the model's own validators (`validate_layout`, `validate_moe`: sizes bounded, heads
    dividing the width, sparse depths agreeing with the sharing), as its config class would check it, without
    transformers; returns the first model's layout (its `block_of_depth` filled in)."""
    layout = config.model_layout(config.initial_blocks(), depth=config.initial_depth())
    try:
        validate_layout(layout)
        if config.model.num_experts:
            validate_moe(layout)
    except ValueError as error:
        raise ConfigError(f"model: {error}") from None
    positions, block_size = config.model.max_position_embeddings, config.data.block_size
    if positions is not None and positions < block_size:
        raise ConfigError(
            f"max_position_embeddings: {positions} is less than block_size ({block_size}), the length the model trains "
            "on; raise it or lower block_size"
        )
    layout.block_of_depth = block_of_depth(layout.num_hidden_layers, layout.num_unique_layers, layout.sharing_pattern)
    return layout


@rule("config")
def check_delinks(config) -> None:
    """Delinks happen in order, within the pseudo stage, and each keeps the function (see `delink_sources`)."""
    m, t = config.model, config.stages
    depth = m.num_hidden_layers
    if t.pseudo_steps == 0:
        # A real model from scratch: the pseudo stage's shape (num_unique_layers, partial_delink_blocks) is unused,
        # but steps given for its delinks cannot be taken.
        if t.partial_delink_steps:
            raise ConfigError(
                "partial_delink_steps: partial delinks need a pseudo stage (pseudo_steps > 0); clear them with "
                "--partial_delink_steps none"
            )
        return
    first = config.initial_depth()
    if first > depth:
        raise ConfigError(
            f"pseudo_num_hidden_layers: the pseudo stage's depth is at most the real model's ({depth}), got {first}"
        )
    if not m.num_unique_layers < depth or m.num_unique_layers > first:
        least = "fewer blocks than layers" if first == depth else "at most as many blocks as its layers"
        raise ConfigError(f"num_unique_layers: the pseudo model needs {least} ({first}), got {m.num_unique_layers}")
    count = len(t.partial_delink_blocks)
    if t.partial_delink_steps and len(t.partial_delink_steps) != count:
        raise ConfigError(
            f"partial_delink_blocks: one entry per partial_delink_steps entry ({len(t.partial_delink_steps)}), "
            f"got {count}"
        )
    if t.partial_delink_depths and len(t.partial_delink_depths) != count:
        raise ConfigError(
            f"partial_delink_depths: one entry per partial_delink_blocks entry ({count}), got "
            f"{len(t.partial_delink_depths)}"
        )
    if count >= t.pseudo_steps:
        raise ConfigError(
            f"partial_delink_blocks: {count} partial delinks need a pseudo stage of more than {count} steps, got "
            f"pseudo_steps={t.pseudo_steps}; give fewer partial_delink_blocks (--partial_delink_blocks none clears "
            "them) or more pseudo_steps"
        )
    previous = 0
    for step in t.partial_delink_steps:
        if not previous < step < t.pseudo_steps:
            raise ConfigError(
                f"partial_delink_steps: steps must increase and lie in (0, pseudo_steps={t.pseudo_steps}), got "
                f"{short(t.partial_delink_steps)}; leave it out (--partial_delink_steps none) for evenly spaced steps "
                f"({short(even_delink_steps(t.pseudo_steps, count))}) or give steps in that range"
            )
        previous = step
    check_growth(config)


def check_growth(config) -> None:
    """Each delink of the run's stages (`stage_schedule`: d -> d' depths, k -> k' blocks) is one the model can make
    (`plan_delink`'s rules: the same function at constant depth, copies of the old layers when growing, a
    function-preserving growth's new blocks all new). The field a broken one names: `partial_delink_blocks` for a
    delink at constant depth, `partial_delink_depths` for a partial growth, `pseudo_num_hidden_layers` (or
    `function_preserving`) for the growth to the real model."""
    m, t = config.model, config.stages
    depth, blocks, real = config.initial_depth(), config.initial_blocks(), m.num_hidden_layers
    schedule = config.stage_schedule()
    grows = any(new_depth > old for (_, new_depth, _), old in zip(schedule, [depth, *(d for _, d, _ in schedule)]))
    if grows and m.num_experts:
        raise ConfigError(
            "pseudo_num_hidden_layers: depth growth of a mixture-of-experts model is not supported by the trainer; "
            "convert a trained shallow checkpoint instead (hf-p2r convert --num-hidden-layers)"
        )
    parallel = config.parallel
    if grows and (parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1):
        raise ConfigError(
            "pseudo_num_hidden_layers: the pipeline engine (pipeline_parallel_size > 1 or data_parallel_size > 1) "
            "delinks at constant depth; grow on one device, DDP or with granular offload"
        )
    for index, (_, new_depth, new_blocks) in enumerate(schedule):
        last = index == len(schedule) - 1
        if not last and new_depth == real and new_blocks >= real:
            raise ConfigError(
                f"partial_delink_blocks: a partial delink keeps fewer blocks than layers ({real}), got {new_blocks}"
            )
        if not depth <= new_depth <= real:
            raise ConfigError(
                f"partial_delink_depths: depths must not decrease and stay at most num_hidden_layers ({real}), got "
                f"{short(t.partial_delink_depths)}"
            )
        if new_blocks > new_depth:
            raise ConfigError(
                f"partial_delink_blocks: a stage has at most as many blocks as its layers, got {new_blocks} blocks at "
                f"depth {new_depth}"
            )
        if new_depth == depth:
            # The final delink (to L blocks) is always valid once every partial stage keeps fewer than L blocks.
            name, problem = "partial_delink_blocks", None
            if not last:
                try:
                    delink_sources(depth, blocks, new_blocks, m.sharing_pattern)
                except ValueError as error:
                    problem = error
        else:
            name = "partial_delink_depths" if not last else "pseudo_num_hidden_layers"
            try:
                plan_delink(
                    config.model_layout(blocks, depth=depth),
                    new_blocks,
                    num_hidden_layers=new_depth,
                    growth=t.growth,
                    function_preserving=t.function_preserving,
                )
                problem = None
            except ValueError as error:
                problem = error
                if t.function_preserving and "function-preserving" in str(error):
                    name = "function_preserving"
        if problem is not None:
            raise ConfigError(f"{name}: {problem}")
        depth, blocks = new_depth, new_blocks


@rule("config")
def check_offloaded_blocks(config) -> None:
    """Block indices name blocks of the first model: every later one (more blocks) has them too."""
    indices = config.offload.offload_spec
    first = config.initial_blocks()
    if isinstance(indices, list) and any(not 0 <= index < first for index in indices):
        stages = " -> ".join(map(str, [first, *(blocks for _, blocks in config.delink_schedule())]))
        raise ConfigError(
            f"offload: block indices {short(indices)} must exist in every model of the run ({stages} blocks: the "
            f"first has blocks 0..{first - 1}); give a ratio of the blocks (0.5) or auto, which choose again after "
            "each delink"
        )


@rule("config")
def check_pipeline(config) -> None:
    """What the pipeline engine (`pipeline_parallel_size > 1` or `data_parallel_size > 1`) runs of the model: a
    manual `pipeline_split` gives every stage layers, adds up to the depth and cuts between blocks of a `sequence`
    pseudo model (`check_split`, which the pipeline runtime applies too); mixture-of-experts models run on the
    Accelerate engine only."""
    p = config.parallel
    if (p.pipeline_parallel_size > 1 or p.data_parallel_size > 1) and config.model.num_experts:
        raise ConfigError(
            "num_experts: mixture-of-experts models are not supported by the pipeline engine (pipeline_parallel_size "
            "> 1 or data_parallel_size > 1) yet; shard one with accelerate launch and the FSDP2 config "
            "(configs/accelerate/fsdp2.yaml)"
        )
    if p.pipeline_split is not None:
        stages = p.pipeline_parallel_size * get_schedule(p.pipeline_schedule).stages_per_process()
        try:
            check_split(check_model(config), p.pipeline_split, stages)
        except ValueError as error:
            raise ConfigError(str(error)) from None


__all__ = ["RULES", "check_run", "check_sections", "rule"]
