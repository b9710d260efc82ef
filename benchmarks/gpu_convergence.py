"""The `convergence` part of the GPU report (issue 39): a model of over 100M parameters trained from scratch and by the
recommended growth recipe on the same tokens (the same steps and batch), within 6 minutes of device time in all. It
writes `OUT/convergence.json`: both validation curves against steps, tokens and FLOPs (the trainer's own counts,
`metrics.jsonl`), each run's final loss and FLOPs, and the recipe's FLOPs to scratch's final loss with the speed-up
(scratch's FLOPs / the recipe's), computed by the CPU study's arithmetic (`benchmarks.convergence.compute.compare`).

The recipe is the CPU study's recommendation (`benchmarks/convergence_compute.json`, the `recommended` recipe; the
G_stack recipe when the study has none yet), run at the GPU model's depth by the same schedule builder. On the same
tokens a growth run spends fewer FLOPs than scratch; the CPU study's equal-compute comparison is the primary measure,
this part checks it at scale.

Dry run (`--dry-run`, in the test suite): a tiny model on CPU, a few steps: it checks the commands, not the machine.
"""

import json
import sys
from pathlib import Path

from benchmarks import presets
from benchmarks.harness import REPO

# benchmarks.convergence.compute (the trainer's packages, datasets) is imported where it is used: `make gpu-report`
# imports this module to list its parts, and its other parts and its argument errors need none of it.

# The GPU model: 8 layers of width 1024 (SwiGLU 2816), 16 heads: 102.8M parameters with the byte-level vocabulary.
GPU_FIELDS = {
    **presets.model(hidden=1024, ffn=2816, heads=16, layers=8),
    # 600 steps of 16 x 512 tokens read 4.9M tokens (bytes): 12 MB of the corpus repeats none. Each run reads and
    # tokenizes its corpus itself (a one-step run on 16 MB took 34 s in all on the 2-core CPU machine)
    **presets.data(block=512, batch=16, corpus=12_000_000),
    **presets.schedule(lr=1e-3, warmup=30, log_every=10, eval_every=50, eval_blocks=64),
    "mixed_precision": "bf16",
}
GPU_STEPS = 600  # per run: on one H200 (2026-11-28) scratch took 54 s and bu-1to8-at80 37 s, the part 91 s
DRY_FIELDS = {
    **presets.TINY_RUN,
    "num_hidden_layers": 8,
    **presets.schedule(lr=2e-3, warmup=2, log_every=2, eval_every=4, eval_blocks=4),
}
DRY_STEPS = 12
FALLBACK = "gstack-2to8-at50"
SHARED = {"lr_scheduler": "wsd", "shared_lr_scale": "depth", "save_total_limit": 1, "overwrite_output_dir": "true"}


def recommended(depth: int) -> str:
    """The recommended recipe of the CPU study's result (benchmarks/convergence_compute.json), else `FALLBACK`."""
    from benchmarks.convergence.compute import STEM, recipes

    path = REPO / "benchmarks" / f"{STEM}.json"
    try:
        name = (json.loads(path.read_text())["recommended"] or {}).get("name")
    except (OSError, ValueError, KeyError, AttributeError):
        name = None
    return name if name in recipes(depth) else FALLBACK


def part_convergence(out: Path, dry: bool, limit: int) -> dict:
    """Scratch, then the recommended recipe, each for the same steps (`GPU_STEPS`; dry: `DRY_STEPS` of a tiny model),
    both within `limit` seconds; the record of `benchmarks.gpu_report.run` with the result."""
    from benchmarks.convergence.compute import compare, recipes, schedule_of
    from benchmarks.gpu_report import run

    fields, steps = (DRY_FIELDS, DRY_STEPS) if dry else (GPU_FIELDS, GPU_STEPS)
    depth = fields["num_hidden_layers"]
    name = recommended(depth)
    book = recipes(depth)
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    records, outputs, record = {}, {}, None
    for run_name, recipe in (("scratch", book["scratch"]), (name, book[name])):
        output_dir = out / "convergence_runs" / run_name
        argv_fields = {**fields, **SHARED, **schedule_of(recipe, steps), "output_dir": str(output_dir)}
        argv = [item for key, value in argv_fields.items() for item in _flag(key, value)]
        left = limit - sum(o["seconds"] for o in outputs.values())
        done = run([sys.executable, "-m", "hf_p2r.train", *argv], max(30, round(left)), env)
        outputs[run_name] = {key: done[key] for key in ("status", "seconds", "command", "output_tail")}
        record = done if record is None or done["status"] != "ok" else record
        if done["status"] != "ok":
            break
        records[run_name] = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"recipe": name, "steps": steps, "model": fields, "commands": outputs}
    if len(records) == 2:
        result.update(compare(records))
        result["parameters"] = _parameters(out / "convergence_runs" / "scratch" / "real")
    record = {**record, "seconds": sum(o["seconds"] for o in outputs.values()), "result": result}
    return record


def _flag(key: str, value) -> list[str]:
    return [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]


def _parameters(model_dir: Path) -> int:
    from benchmarks.convergence.runs import parameters

    return parameters(model_dir)


__all__ = ["GPU_FIELDS", "part_convergence", "recommended"]
