"""`TrainConfig`: the whole run's configuration, its sections (`hf_p2r.config.sections`), and what is derived from it in
one place: the delink schedule, the blocks at each step, the learning-rate schedule, the flat record a checkpoint
keeps, the model's config.

Plain Python; only `p2r_config` (which builds transformers' config class) imports transformers, when called.
"""

import dataclasses
import re
import types
from dataclasses import dataclass
from typing import Any

from ..models.p2r.sharing_p2r import plan_delink
from .fields import ConfigError, build
from .flat import TRAIN_SECTIONS, TrainArguments
from .rules import check_run
from .sections import (
    MOE_FIELDS,
    SECTION_OF,
    SECTIONS,
    CheckpointArguments,
    ComputeArguments,
    DataArguments,
    LearningRateSchedule,
    LoggingArguments,
    ModelArguments,
    OffloadArguments,
    OptimizerArguments,
    ParallelArguments,
    ScheduleArguments,
    StageArguments,
    even_delink_steps,
)


@dataclass
class TrainConfig:
    """The whole run, by section: `config.model`, `config.data`, `config.stages`, `config.optim`, `config.schedule`,
    `config.offload`, `config.parallel`, `config.compute`, `config.checkpointing`, `config.logging`. Each part of the
    trainer is given the sections it reads. `TrainConfig.from_dict` builds one from flat values, checked."""

    model: ModelArguments
    data: DataArguments
    stages: StageArguments
    optim: OptimizerArguments
    schedule: ScheduleArguments
    offload: OffloadArguments
    parallel: ParallelArguments
    compute: ComputeArguments
    checkpointing: CheckpointArguments
    logging: LoggingArguments

    def __post_init__(self):
        # What the run says before it starts (a resume: the saved configuration and what the flags change). Not a
        # field: the configuration's fields are its sections.
        self.notes: list[str] = []

    @classmethod
    def from_dict(cls, values: dict[str, Any], check: bool = True) -> "TrainConfig":
        """The configuration of flat {field: value} (each field's default where absent), every value checked by its
        field (`ConfigError` naming it), then, with `check`, the rules between fields (`hf_p2r.config.rules`).
        Unknown keys are a `ConfigError` too."""
        if unknown := sorted(key for key in values if key not in SECTION_OF):
            raise ConfigError(f"{short_names(unknown)}: not a field of the trainer (see --help for the fields)")
        parts = {
            name: build(kind, {key: value for key, value in values.items() if SECTION_OF[key] is kind})
            for name, kind in SECTIONS.items()
        }
        config = cls(**parts)
        if check:
            check_run(config)
        return config

    def sections(self) -> dict[str, Any]:
        """{section name: section}, in `SECTIONS`' order."""
        return {name: getattr(self, name) for name in SECTIONS}

    @property
    def train(self) -> TrainArguments:
        """Every section but the model's and the data's as one flat object (`TrainArguments`), for code written
        before the sections: reads and writes go to this configuration's own sections."""
        return TrainArguments.of({name: part for name, part in self.sections().items() if name in TRAIN_SECTIONS})

    def to_dict(self) -> dict[str, Any]:
        """Flat {field: value}, the YAML layout (recorded in every checkpoint and given to trackers), resolved: the
        partial delinks' steps are the ones the run takes (`delink_schedule`), also where they were left to default."""
        values = {key: value for part in self.sections().values() for key, value in dataclasses.asdict(part).items()}
        if self.stages.pseudo_steps:
            values["partial_delink_steps"] = [step for step, _ in self.delink_schedule()[:-1]]
        return values

    def lr_schedule(self) -> LearningRateSchedule:
        """The learning rate's schedule (`hf_p2r.training.optim.learning_rate_at` reads it)."""
        return LearningRateSchedule.of(self.optim, self.schedule, self.stages)

    def delink_schedule(self) -> list[tuple[int, int]]:
        """[(step, blocks after the delink at that step)], ending with (pseudo_steps, L); empty for a scratch run.

        The one place the schedule is resolved (the trainer, the pipelined trainer and the planner read it): the
        partial delinks' steps are `partial_delink_steps`, or, left out, evenly spaced over the pseudo stage
        (`even_delink_steps`).

        ```python
        >>> config = parse_config(["--config", "configs/demo.yaml", "--pseudo_steps", "50"])
        >>> config.delink_schedule()  # partial_delink_blocks: [2, 4], 8 layers
        [(17, 2), (33, 4), (50, 8)]
        ```
        """
        t = self.stages
        if t.pseudo_steps == 0:
            return []
        steps = t.partial_delink_steps or even_delink_steps(t.pseudo_steps, len(t.partial_delink_blocks))
        return [*zip(steps, t.partial_delink_blocks), (t.pseudo_steps, self.model.num_hidden_layers)]

    def stage_schedule(self) -> list[tuple[int, int, int]]:
        """[(step, depth, blocks after the delink at that step)]: `delink_schedule` with the depth of each stage, ending
        with (pseudo_steps, L, L); empty for a scratch run. A delink to a deeper model grows it (`growth`): the
        partial delinks' depths are `partial_delink_depths` (left out: the depth stays), the pseudo stage's first
        depth `pseudo_num_hidden_layers` (`initial_depth`)."""
        schedule, depths = self.delink_schedule(), self.stages.partial_delink_depths
        stages, depth = [], self.initial_depth()
        for index, (step, blocks) in enumerate(schedule):
            if index == len(schedule) - 1:
                depth = self.model.num_hidden_layers
            elif depths:
                depth = depths[index]
            stages.append((step, depth, blocks))
        return stages

    def initial_blocks(self) -> int:
        """Blocks of the model at step 0: k for a P2R run, L for a real model trained from scratch."""
        return self.model.num_unique_layers if self.stages.pseudo_steps else self.model.num_hidden_layers

    def initial_depth(self) -> int:
        """Depth of the model at step 0: `pseudo_num_hidden_layers` (default L) for a P2R run, L from scratch."""
        depth = self.model.num_hidden_layers
        return (self.stages.pseudo_num_hidden_layers or depth) if self.stages.pseudo_steps else depth

    def stage_at(self, step: int) -> tuple[int, int]:
        """(depth, blocks) of the model once every delink due at `step` (or before) is done."""
        stage = (self.initial_depth(), self.initial_blocks())
        for delink_step, depth, blocks in self.stage_schedule():
            if delink_step <= step:
                stage = (depth, blocks)
        return stage

    def blocks_at(self, step: int) -> int:
        """Blocks the model must have once every delink due at `step` (or before) is done."""
        blocks = self.initial_blocks()
        for delink_step, new_blocks in self.delink_schedule():
            if delink_step <= step:
                blocks = new_blocks
        return blocks

    def delink_to(self, depth: int, num_blocks: int, new_depth: int, new_blocks: int):
        """What the trainer's delink takes to go from a model of `depth` layers and `num_blocks` blocks to `new_depth`
        and `new_blocks`: the block count at the same depth (None: the real model), or the `DelinkPlan` of a depth
        growth (`plan_delink` with `growth` and `function_preserving`)."""
        if new_depth == depth:
            return new_blocks if new_blocks < self.model.num_hidden_layers else None
        t = self.stages
        return plan_delink(
            self.model_layout(num_blocks, depth=depth),
            new_blocks,
            num_hidden_layers=new_depth,
            growth=t.growth,
            function_preserving=t.function_preserving,
        )

    def model_vocab_size(self, tokenizer_size: int) -> int:
        """The model's embedding rows for a tokenizer of `tokenizer_size` tokens: `vocab_size`, or the tokenizer's size
        rounded up to 64 (friendlier matrix shapes); `ConfigError` if `vocab_size` is smaller than the tokenizer."""
        vocab_size = self.model.vocab_size or -(-tokenizer_size // 64) * 64
        if vocab_size < tokenizer_size:
            raise ConfigError(f"vocab_size: {vocab_size} is smaller than the tokenizer ({tokenizer_size} tokens)")
        return vocab_size

    def model_fields(self, vocab_size: int, num_blocks: int, depth: int | None = None) -> dict[str, Any]:
        """The model's config fields with `num_blocks` blocks (k < L: pseudo; L: real) at `depth` layers (default L;
        fewer: a shallow stage, which records L as `real_num_hidden_layers`), as `p2r_config` passes them (without the
        tokenizer's special tokens)."""
        m, real = self.model, self.model.num_hidden_layers
        depth = depth or real
        moe = {name: getattr(m, name) for name in MOE_FIELDS} if m.num_experts else {}
        return dict(
            vocab_size=vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_hidden_layers=depth,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads or m.num_attention_heads,
            head_dim=m.head_dim,
            hidden_act=m.hidden_act,
            max_position_embeddings=m.max_position_embeddings or self.data.block_size,
            initializer_range=m.initializer_range,
            rms_norm_eps=m.rms_norm_eps,
            tie_word_embeddings=m.tie_word_embeddings,
            rope_parameters={"rope_type": "default", **(m.rope_scaling or {}), "rope_theta": m.rope_theta},
            attention_bias=m.attention_bias,
            attention_dropout=m.attention_dropout,
            mlp_bias=m.mlp_bias,
            share_layers=num_blocks < depth,
            num_unique_layers=num_blocks if num_blocks < depth else None,
            sharing_pattern=m.sharing_pattern,
            real_num_hidden_layers=real if depth < real else None,
            depth_mup=m.depth_mup,
            **moe,
        )

    def model_layout(
        self, num_blocks: int, vocab_size: int | None = None, depth: int | None = None
    ) -> types.SimpleNamespace:
        """The model's fields as the model's own torch-free validators (`validate_layout`, `validate_moe`), the delink
        planner (`plan_delink`) and the pipeline split read them: what `p2r_config` would build, without transformers
        (the defaults P2RConfig fills in filled the same way)."""
        fields = self.model_fields(vocab_size or self.model.vocab_size or 256, num_blocks, depth)
        if self.model.num_experts:
            fields.update(output_router_logits=False)
            fields["moe_intermediate_size"] = fields["moe_intermediate_size"] or fields["intermediate_size"]
        return types.SimpleNamespace(**fields)

    def p2r_config(
        self, vocab_size: int, num_blocks: int, special_tokens: dict[str, int | None], depth: int | None = None
    ):
        """The model's P2RConfig with `num_blocks` blocks (k < L: pseudo; L: real) at `depth` layers (default L); a
        P2RMoeConfig if `num_experts`. (Imports transformers: the trainer and the planner call it once the configuration
        is known to be valid.)"""
        from huggingface_hub.errors import StrictDataclassError
        from transformers.activations import ACT2FN
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        from ..models.p2r import P2RConfig, P2RMoeConfig

        m = self.model
        if m.hidden_act not in ACT2FN:
            known = ", ".join(sorted(ACT2FN))
            raise ConfigError(f"hidden_act: {m.hidden_act!r} is not one of transformers' activations ({known})")
        rope_type = (m.rope_scaling or {}).get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            known = ", ".join(ROPE_INIT_FUNCTIONS)
            raise ConfigError(f"rope_scaling: rope_type {rope_type!r} is not one of transformers' ({known})")
        config_class = P2RMoeConfig if m.num_experts else P2RConfig
        try:
            return config_class(
                **self.model_fields(vocab_size, num_blocks, depth),
                attn_implementation=m.attn_implementation,
                **special_tokens,
            )
        except (StrictDataclassError, ValueError, KeyError, TypeError) as error:
            # huggingface_hub wraps the validator's message in context lines: keep the message of the last one.
            message = str(error).strip().strip('"').splitlines()[-1].strip()
            raise ConfigError(f"model: {re.sub(r'^[A-Za-z]+Error: ', '', message)}") from None


def short_names(names: list[str]) -> str:
    return ", ".join(repr(name)[:60] for name in names[:8]) + (", ..." if len(names) > 8 else "")
