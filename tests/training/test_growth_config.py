"""configs/grow.yaml (issue 39): a complete configuration of the recommended growth recipe, read by the trainer's own
parser, that runs (here a few steps of it) as `hf-p2r train --config configs/grow.yaml` does."""

import json

import yaml

from hf_p2r.training import parse_config, train
from hf_p2r.training.metrics import read_metrics

from .helpers import REPO

GROW = REPO / "configs" / "grow.yaml"


def test_grow_yaml_parses_into_a_shallow_stage_grown_to_the_real_model():
    config = parse_config(["--config", str(GROW)])
    depth = config.model.num_hidden_layers
    first = (config.initial_depth(), config.initial_blocks())
    assert first[0] < depth  # a shallow pseudo stage: the compute it saves
    assert config.stage_schedule()[-1] == (config.stages.pseudo_steps, depth, depth)
    assert config.schedule.lr_scheduler == "wsd"
    # every key of the file is a trainer field, given as the file gives it
    values = config.to_dict()
    assert all(values[key] == value for key, value in yaml.safe_load(GROW.read_text()).items())


def test_grow_yaml_trains_through_its_growth(tmp_path):
    """A few steps of the file's own schedule (its stages scaled down), on its corpus and model."""
    output_dir = tmp_path / "grow"
    argv = ["--config", str(GROW), "--output_dir", str(output_dir), "--pseudo_steps", "2", "--real_steps", "1"]
    argv += ["--warmup_steps", "1", "--eval_steps", "0", "--eval_blocks", "4", "--corpus_max_bytes", "100000"]
    assert train(parse_config([*argv, "--cpu", "true", "--logging_steps", "1"])) == 0
    records = read_metrics(output_dir / "metrics.jsonl")
    config = parse_config(["--config", str(GROW)])
    [delink] = [r for r in records if r.get("event") == "delink"]
    assert (delink["num_hidden_layers_before"], delink["num_hidden_layers"]) == (config.initial_depth(), 8)
    assert [r["num_hidden_layers"] for r in records if "loss" in r] == [config.initial_depth()] * 2 + [8]
    assert json.loads((output_dir / "real" / "config.json").read_text())["num_hidden_layers"] == 8
