"""Metrics: `metrics.jsonl` (one JSON record per logged step) and the loss-curve PNG drawn from it.

A record has `step`, `stage` ("pseudo" or "real"), `num_blocks`, `num_hidden_layers` (the depth the model runs),
`tokens` and `flops` (cumulative: the training tokens and the model's training FLOPs so far, forward + backward of the
depth each step ran, `training_flops_per_token`), and, when measured at that step, `loss` (mean training loss since
the previous record), `lr`, `grad_norm`, `tokens_per_s`, `train_time_s`, `memory_gb` (peak GPU memory allocated by
torch, or the process's peak RSS on CPU) and `val_loss`. A delink adds a record with `"event": "delink"`,
`num_blocks_before`, `num_hidden_layers_before` and the new `num_blocks` and `num_hidden_layers`, at the step after
which it happened (a depth growth is a delink).
"""

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, parse_json
from ..models.p2r.inventory_p2r import inventory

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def training_flops_per_token(model_config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the model `model_config` describes (a `P2RConfig`, or its
    fields as a dict) on sequences of `seq_len` tokens: `inventory(config).flops(seq_len)`, the one formula the planner
    and the GPU report's MFU use too (every depth it runs, attention scores, the head)."""
    return inventory(model_config).flops(seq_len)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` file (an empty list if there is none); a damaged line is an `InputError`
    naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, "rb") as file:
        lines = file.read().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            record = parse_json(line, f"{path} line {number}")
            if not isinstance(record, dict):
                raise InputError(f"{path} line {number}: expected a JSON object")
            records.append(record)
    return records


def truncate_metrics(path: str | Path, keep: int) -> None:
    """Keep the first `keep` records (a resumed run writes the others again); the file is replaced atomically."""
    path = Path(path)
    records = read_metrics(path)[:keep]
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        partial.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def append_metrics(path: str | Path, record: dict[str, Any]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
    except OSError as error:
        raise OSError(f"{path}: could not append a record ({error.strerror or error})") from None


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def plot_losses(records: list[dict[str, Any]], path: str | Path, title: str = "") -> bool:
    """Write the loss-curve PNG of `draw_losses` to `path`; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(8, 4.5))
    draw_losses(axes, records, title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def draw_losses(axes, records: list[dict[str, Any]], title: str = "") -> None:
    """Training and validation loss against steps on matplotlib `axes`, a dashed line at each delink."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    validation = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        axes.plot(*zip(*train), label="training loss", linewidth=1)
    if validation:
        axes.plot(*zip(*validation), "o-", label="validation loss", markersize=3)
    for step, blocks in delink_points(records):
        axes.axvline(step, color="gray", linestyle="--", linewidth=1)
        axes.annotate(
            f"delink -> {blocks} blocks",
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="gray",
        )
    axes.set(xlabel="optimizer step", ylabel="loss (nats/token)", title=title)
    axes.legend()


def delink_points(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """[(step, blocks after)] of the delink records (`"event": "delink"`)."""
    return [(record["step"], record["num_blocks"]) for record in records if record.get("event") == "delink"]


def stage_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage of a run, in order, from its metrics records: `stage`, `steps` (from, to: a stage starts where the
    previous one ended, the first at step 0), `blocks` and `depths` (the model's block counts and depths in that stage,
    in order), `val_loss` (the last one measured in it, None if none), `tokens_per_s` (tokens over training time in
    it, None without timed records), `train_time_s`, and `tokens` and `flops` (the training tokens and FLOPs spent in
    it, from the records' cumulative counts; None where the records have none).

    A training record's time is the step time since the previous one (`train_time_s` is cumulative), counted in the
    stage of the record that ends it."""
    stages: dict[str, dict[str, Any]] = {}
    tokens: dict[str, float] = {}
    previous_time = 0.0
    spent = {"tokens": 0, "flops": 0.0}  # the cumulative counts at the end of the previous stage
    for record in records:
        name, step = record["stage"], record["step"]
        if name not in stages:
            start = max((stage["steps"][1] for stage in stages.values()), default=0)
            stages[name] = dict(stage=name, steps=(start, step), blocks=[], depths=[], val_loss=None, tokens_per_s=None)
            stages[name]["train_time_s"], tokens[name] = 0.0, 0.0
            stages[name].update(tokens=None, flops=None, start={**spent})
        stage = stages[name]
        stage["steps"] = (stage["steps"][0], step)
        if record["num_blocks"] not in stage["blocks"]:
            stage["blocks"].append(record["num_blocks"])
        depth = record.get("num_hidden_layers")
        if depth is not None and depth not in stage["depths"]:
            stage["depths"].append(depth)
        stage["val_loss"] = record.get("val_loss", stage["val_loss"])
        for key in ("tokens", "flops"):
            if key in record:
                stage[key], spent[key] = record[key] - stage["start"][key], record[key]
        if "train_time_s" in record and "tokens_per_s" in record:
            elapsed, previous_time = record["train_time_s"] - previous_time, record["train_time_s"]
            stage["train_time_s"] += elapsed
            tokens[name] += record["tokens_per_s"] * elapsed
    for name, stage in stages.items():
        del stage["start"]
        if stage["train_time_s"] > 0:
            stage["tokens_per_s"] = tokens[name] / stage["train_time_s"]
    return list(stages.values())
