"""The configuration in sections (issue 38, point 3): every field declared once in its section with its help and its
checks (`hf_p2r.config.fields`), the rules between fields in one module, flat YAML keys and flags as before (every
preset and every field name of the flat configuration load unchanged), and the flat `TrainArguments` a view of the
sections."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_p2r import P2RForCausalLM
from hf_p2r.config import SECTIONS, ConfigError, TrainArguments, TrainConfig, parse_config
from hf_p2r.config.flat import TrainArguments as FlatView
from hf_p2r.config.parse import read_yaml
from hf_p2r.config.rules import RULES
from hf_p2r.training import train
from hf_p2r.training.optim import build_optimizer, learning_rate_at

from .helpers import REPO, tiny_argv

# Every field of the flat configuration (hf_p2r/training/config.py before the sections): the keys users' YAML files
# and command lines hold.
FLAT_FIELDS = """
hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads num_unique_layers
sharing_pattern vocab_size tie_word_embeddings initializer_range rope_theta attn_implementation
activation_checkpointing num_experts num_experts_per_tok moe_intermediate_size decoder_sparse_step mlp_only_layers
norm_topk_prob num_expert_groups router_aux_loss_coef dataset_name dataset_config_name train_files text_column
streaming validation_files corpus_max_bytes tokenizer_name block_size validation_fraction preprocessing_num_workers
cache_dir output_dir overwrite_output_dir resume_from_checkpoint seed pseudo_steps real_steps partial_delink_steps
partial_delink_blocks optimizer_carry shared_lr_scale lr_after_delink rewarm_steps per_device_batch_size
gradient_accumulation_steps learning_rate lr_scheduler lr_decay_fraction warmup_steps min_lr_ratio weight_decay
adam_beta1 adam_beta2 adam_epsilon optimizer muon_learning_rate muon_momentum muon_adjust_lr_fn max_grad_norm
mixed_precision cpu compile compile_backend loss_kernel logging_steps eval_steps eval_blocks save_steps
save_total_limit checkpoint_format checkpoint_async report_to remote_code offload offload_budget_gb offload_prefetch
offload_optimizer offload_chunk_mb pipeline_parallel_size pipeline_schedule pipeline_delay_correction
num_microbatches pipeline_split data_parallel_size data_parallel_shard
""".split()
FIELDS = {name: section for section in SECTIONS.values() for name in section.__dataclass_fields__}


def test_every_field_is_declared_once_with_its_help():
    names = [name for section in SECTIONS.values() for name in section.__dataclass_fields__]
    assert len(names) == len(set(names))  # a flat key names one field
    assert set(FLAT_FIELDS) <= set(names)
    for name, section in FIELDS.items():
        assert section.__dataclass_fields__[name].metadata["help"].strip(), name


def test_the_rules_between_fields_live_in_the_rules_module():
    """A section checks its own fields only (declared, no `__post_init__`); every rule is registered in `RULES`."""
    assert not any("__post_init__" in vars(section) for section in SECTIONS.values())
    assert {function.__module__ for function, _ in RULES} == {"hf_p2r.config.rules"}
    assert {name for _, names in RULES for name in names} <= {*SECTIONS, "config"}


@pytest.mark.parametrize("preset", sorted(path.name for path in (REPO / "configs").glob("*.yaml")))
def test_every_preset_loads_unchanged(preset):
    """Each key of the file keeps its value (as the command line would read it) in the configuration."""
    path = REPO / "configs" / preset
    written, config = read_yaml(path), parse_config(["--config", str(path)])
    values = config.to_dict()
    assert set(yaml.safe_load(path.read_text())) <= set(FIELDS)  # the presets use the flat keys
    assert {key: values[key] for key in written} == written


def test_a_file_of_every_flat_key_loads():
    defaults = parse_config([]).to_dict()
    document = {name: defaults[name] for name in FLAT_FIELDS}
    config = TrainConfig.from_dict(document)
    assert {name: config.to_dict()[name] for name in FLAT_FIELDS} == document


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("rewarm_steps", "0", "rewarm_steps: must satisfy 1 <= rewarm_steps, got 0"),
        ("adam_beta2", "1.0", "adam_beta2: must satisfy 0.0 <= adam_beta2 < 1.0, got 1.0"),
        ("offload_chunk_mb", "inf", "offload_chunk_mb: expected a finite number, got inf"),
        ("offload", "lots", "offload: expected auto, a ratio between 0 and 1 (0.5) or a list of block indices"),
        ("rope_scaling", "{factor: 2}", "rope_scaling: needs a rope_type"),
        ("head_dim", "0", "head_dim: must satisfy 1 <= head_dim, got 0"),
    ],
)
def test_a_fields_declared_checks_refuse_in_one_line(flag, value, message):
    with pytest.raises(ConfigError) as raised:
        parse_config([f"--{flag}", value])
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_section_built_in_code_is_checked_too():
    sections = {name: section for name, section in SECTIONS.items()}
    with pytest.raises(Exception, match="weight_decay"):
        sections["optim"](weight_decay=-1.0)
    with pytest.raises(Exception, match="pseudo_steps"):
        sections["stages"](pseudo_steps="3")


def test_train_arguments_is_a_flat_view_of_the_sections():
    config = parse_config(["--config", str(REPO / "configs/demo.yaml")])
    flat = config.train
    assert (flat.optimizer_carry, flat.learning_rate, flat.total_steps) == (
        config.stages.optimizer_carry,
        config.optim.learning_rate,
        config.stages.total_steps,
    )
    flat.learning_rate = 1e-4  # written to its section
    assert config.optim.learning_rate == 1e-4
    with pytest.raises(AttributeError):
        flat.no_such_field = 1
    assert TrainArguments(optimizer="muon", learning_rate=1).learning_rate == 1.0  # checked and converted as flags
    with pytest.raises(ConfigError, match=r"^warmup_steps: the warm-up \(30 steps\) is longer than the run"):
        TrainArguments(pseudo_steps=10, real_steps=10, warmup_steps=30)  # the rules among its sections
    with pytest.raises(TypeError, match="hidden_size"):
        TrainArguments(hidden_size=8)  # a model field: not one of its sections'


def test_each_part_takes_its_section(tmp_path):
    """The optimizer from the optimizer section alone, the learning rate from the schedule the config resolves: the
    same as from the flat view."""
    config = parse_config(["--config", str(REPO / "configs/demo.yaml"), "--hidden_size", "32", "--num_attention_heads",
                           "2", "--intermediate_size", "64", "--vocab_size", "64"])  # fmt: skip
    with torch.device("meta"):
        model = P2RForCausalLM(config.p2r_config(64, 1, {}))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in build_optimizer(model, config.optim).param_groups]
    flat = [{k: v for k, v in g.items() if k != "params"} for g in build_optimizer(model, config.train).param_groups]
    assert groups == flat
    schedule, delinks = config.lr_schedule(), [27, 53]
    assert [learning_rate_at(s, schedule, delinks) for s in range(240)] == [
        learning_rate_at(s, config.train, delinks) for s in range(240)
    ]
    assert dataclasses.is_dataclass(config.optim) and not hasattr(config.optim, "optimizer_carry")


def test_the_saved_folders_carry_no_code_by_default_and_depth_mup_reaches_the_optimizer():
    """remote_code defaults to false (issue 37.2: no auto_map, so `import hf_p2r` then AutoTokenizer /
    AutoModelForCausalLM load without transformers asking; test_train and test_usage_snippets run those loads); the
    model section's depth_mup reaches the model's config and, through it, the blocks' learning rates."""
    assert parse_config([]).checkpointing.remote_code is False
    config = parse_config(["--depth_mup", "true", "--num_hidden_layers", "4", "--pseudo_steps", "0"])
    with torch.device("meta"):
        model = P2RForCausalLM(config.p2r_config(256, 4, {}))
    assert model.config.depth_mup and model.config.block_lr_scale == 0.5
    scales = {group["lr_scale"] for group in build_optimizer(model, config.optim).param_groups}
    assert scales == {0.5, 1.0}


# Where each section may go, as hf_p2r/config/sections.py's table promises: the files (under hf_p2r/) whose functions
# take it as an argument, besides the configuration package itself. The engines hold the compute section and their
# own (offload; parallel for the pipeline engine, not traced here) and take values of the others (`engine_for`); the
# optimizer section reaches them as `optimizer_factory(optim)`, a delink as the engine's factory and placement.
SECTION_READERS = {
    "model": set(),  # (read through TrainConfig.p2r_config by build_model)
    "data": {f"training/data/{name}.py" for name in ("documents", "packing", "source", "blocks", "streaming")},
    "stages": set(),  # (TrainConfig's schedules; the engines take optimizer_carry)
    "optim": {"training/optim.py"},
    "schedule": set(),  # (TrainConfig.lr_schedule)
    "offload": {"training/offload.py", "training/engines/accelerate.py"},
    "parallel": {"training/engines/pipeline.py"},
    "compute": {"training/engines/base.py", "training/engines/accelerate.py", "training/engines/pipeline.py"},
    "checkpointing": {"training/run.py"},
    "logging": {"training/run.py"},
}
# The functions given the whole configuration: the run's top, the engine's choice, what a checkpoint records and
# checks.
WHOLE_CONFIG = {
    "training/train.py:train",
    "training/train.py:run",
    "training/train.py:build_model",
    "training/engines/__init__.py:engine_for",
    "training/resume/checkpoints.py:save_checkpoint",
    "training/resume/checkpoints.py:read_state",
}


def test_each_section_is_given_to_its_part_of_the_trainer(tmp_path):
    """A traced one-process run (pseudo stage, a partial delink, the delink, the real stage, checkpoints): every
    function of hf_p2r called with a section takes only the sections its part reads (SECTION_READERS), and only the
    few at the top take the whole configuration (WHOLE_CONFIG); the data, the optimizer and the log are each reached
    with their own section."""
    package = str(REPO / "hf_p2r") + os.sep
    kinds = {cls: name for name, cls in SECTIONS.items()}
    received: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(package):
            return
        where = f"{Path(code.co_filename).relative_to(REPO / 'hf_p2r')}:{code.co_qualname}"
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            value = frame.f_locals.get(name)
            if type(value) is TrainConfig:
                received.setdefault(where, set()).add("config")
            elif type(value) in kinds:
                received.setdefault(where, set()).add(kinds[type(value)])
            elif type(value) is FlatView:
                received.setdefault(where, set()).update(value.__dict__["_sections"])

    config = parse_config(tiny_argv(tmp_path / "run", pseudo_steps=2, real_steps=2, partial_delink_blocks=2,
                                    save_steps=2))  # fmt: skip
    sys.setprofile(profile)
    try:
        assert train(config) == 0
    finally:
        sys.setprofile(None)
    outside = {where: names for where, names in received.items() if not where.startswith("config/")}
    whole = {where for where, names in outside.items() if "config" in names}
    assert whole <= WHOLE_CONFIG, sorted(whole - WHOLE_CONFIG)
    strays = {
        f"{where} takes {name}"
        for where, names in outside.items()
        for name in names - {"config"}
        if where.split(":")[0] not in SECTION_READERS[name]
    }
    assert not strays, sorted(strays)
    assert {"data"} <= received["training/data/blocks.py:build_blocks"]
    assert received["training/optim.py:optimizer_factory"] == {"optim"}
    assert received["training/engines/accelerate.py:AccelerateEngine.__init__"] == {"compute", "offload"}
    assert received["training/run.py:StepLog.__init__"] == {"logging"}
