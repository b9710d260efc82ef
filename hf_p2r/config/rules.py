"""The rules that compare fields of several sections of a `TrainConfig`: the one validator the trainer and the planner
(`hf-p2r plan --config run.yaml`) share, so both refuse the same configurations with the same line.

`check_run` runs them all, in an order that bounds the model's sizes (the model's own validators) before any rule
builds something that scales with them. Plain Python (no torch, no transformers).
"""

from ..distributed.pipeline.schedules import get_schedule
from ..distributed.pipeline.split import check_split
from ..models.p2r.sharing_p2r import block_of_depth, delink_sources, validate_layout, validate_moe
from .fields import ConfigError, short
from .run import TrainConfig, even_delink_steps


def check_run(config: TrainConfig) -> None:
    """Every cross-section rule, first failure raised as one `ConfigError` naming the field."""
    layout = check_model(config)
    check_schedule(config)
    check_offload(config)
    check_pipeline(config, layout)


def check_model(config: TrainConfig):
    """The model's shape by the model's own validators (`validate_layout`, `validate_moe`: sizes bounded, heads
    dividing the width, sparse depths agreeing with the sharing), as its config class would check it, without
    transformers; returns the first model's layout (its `block_of_depth` filled in)."""
    layout = config.model_layout(config.initial_blocks())
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


def check_schedule(config: TrainConfig) -> None:
    """Delinks happen in order, within the pseudo stage, and each keeps the function (see `delink_sources`)."""
    m, t = config.model, config.train
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
    if not m.num_unique_layers < depth:
        raise ConfigError(
            f"num_unique_layers: the pseudo model needs fewer blocks than layers ({depth}), got {m.num_unique_layers}"
        )
    count = len(t.partial_delink_blocks)
    if t.partial_delink_steps and len(t.partial_delink_steps) != count:
        raise ConfigError(
            f"partial_delink_blocks: one entry per partial_delink_steps entry ({len(t.partial_delink_steps)}), "
            f"got {count}"
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
    blocks = m.num_unique_layers
    for new_blocks in t.partial_delink_blocks:
        # The final delink (to L blocks) is always valid once every partial stage keeps fewer than L blocks.
        if new_blocks >= depth:
            raise ConfigError(
                f"partial_delink_blocks: a partial delink keeps fewer blocks than layers ({depth}), got {new_blocks}"
            )
        try:
            delink_sources(depth, blocks, new_blocks, m.sharing_pattern)
        except ValueError as error:
            raise ConfigError(f"partial_delink_blocks: {error}") from None
        blocks = new_blocks


def check_offload(config: TrainConfig) -> None:
    """Block indices name blocks of the first model: every later one (more blocks) has them too."""
    indices = config.train.offload_spec
    first = config.initial_blocks()
    if isinstance(indices, list) and any(not 0 <= index < first for index in indices):
        stages = " -> ".join(map(str, [first, *(blocks for _, blocks in config.delink_schedule())]))
        raise ConfigError(
            f"offload: block indices {short(indices)} must exist in every model of the run ({stages} blocks: the "
            f"first has blocks 0..{first - 1}); give a ratio of the blocks (0.5) or auto, which choose again after "
            "each delink"
        )


def check_pipeline(config: TrainConfig, layout) -> None:
    """What the pipeline engine (`pipeline_parallel_size > 1` or `data_parallel_size > 1`) runs of the model: a
    manual `pipeline_split` gives every stage layers, adds up to the depth and cuts between blocks of a `sequence`
    pseudo model (`check_split`, which the pipeline runtime applies too); mixture-of-experts models run on the
    Accelerate engine only."""
    t = config.train
    pipelined = t.pipeline_parallel_size > 1 or t.data_parallel_size > 1
    if pipelined and config.model.num_experts:
        raise ConfigError(
            "num_experts: mixture-of-experts models are not supported by the pipeline engine (pipeline_parallel_size "
            "> 1 or data_parallel_size > 1) yet; shard one with accelerate launch and the FSDP2 config "
            "(configs/accelerate/fsdp2.yaml)"
        )
    if t.pipeline_split is not None:
        stages = t.pipeline_parallel_size * get_schedule(t.pipeline_schedule).stages_per_process()
        try:
            check_split(layout, t.pipeline_split, stages)
        except ValueError as error:
            raise ConfigError(str(error)) from None


__all__ = ["check_model", "check_offload", "check_pipeline", "check_run", "check_schedule"]
