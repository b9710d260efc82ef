"""What the delayed offload update costs in loss: the trainer on CPU, side by side, with the same seed and data, with
half of a real model's blocks offloaded (gradients summed on the device) and their update `after_backward` (exact:
training without offload's, bit for bit), `delayed` (ZeRO-Offload's delayed parameter update: one step stale) and
`delayed` with PipeDream-2BW's error-feedback correction.

    python scripts/bench_offload_delayed.py            # writes benchmarks/offload_delayed.{json,md} (minutes on CPU)
    python scripts/bench_offload_delayed.py --smoke    # seconds: checks the script, not a result

Each run is `python -m hf_p2r.train` in its own process, one after the other. The page gives each run's training loss
(the mean over windows of steps) and validation loss against the exact run's, and says whether the delay is free at
this size. A delay that costs loss here is not made the default (issue 40: never the default unless free).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import presets
from benchmarks.harness import REPO, load_averages, machine, publish, utc_now

RUNS = {
    "after_backward": {},
    "delayed": {"offload_update": "delayed"},
    "delayed + error_feedback": {"offload_update": "delayed", "offload_delay_correction": "error_feedback"},
}
COMMON = {
    "pseudo_steps": 0,  # the real model from the start: the delay is what differs
    "offload": "0.5",
    "offload_grad_accumulation": "device",
    "gradient_accumulation_steps": 2,
    "seed": 0,
    "cpu": "true",
    "save_steps": 0,
    "save_total_limit": 1,
}
PRESETS = {
    "cpu": {
        **presets.CPU_RUN,
        **presets.schedule(lr=2e-3, warmup=20, log_every=5, eval_every=50, eval_blocks=64),
        "real_steps": 300,
    },
    "smoke": {
        **presets.TINY_RUN,
        **presets.schedule(lr=3e-3, warmup=2, log_every=1, eval_every=3, eval_blocks=8),
        "real_steps": 6,
    },
}


def run(name: str, fields: dict, folder: Path) -> dict:
    argv = [f"--{k}={v}" for k, v in {**fields, "output_dir": folder, "overwrite_output_dir": "true"}.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hf_p2r.train", *argv], cwd=REPO, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{name}: the trainer failed:\n{(done.stdout + done.stderr)[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "seconds": time.perf_counter() - started,
        "loss": {r["step"]: r["loss"] for r in records if "loss" in r},
        "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
    }


def windows(loss: dict, size: int) -> list[tuple[int, float]]:
    """(last step, mean loss) over consecutive windows of `size` logged steps."""
    steps = sorted(loss, key=int)
    return [
        (steps[i + size - 1], sum(loss[s] for s in steps[i : i + size]) / size)
        for i in range(0, len(steps) - size + 1, size)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps of a tiny model: checks the script")
    parser.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/offload_delayed)")
    parser.add_argument("--work", type=Path, help="folder for the runs (default runs/offload_delayed)")
    args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "cpu"]
    out = args.out or REPO / ("runs/offload_delayed_smoke" if args.smoke else "benchmarks/offload_delayed")
    work = args.work or REPO / "runs" / "offload_delayed"
    result = {
        "date": utc_now(),
        "machine": machine(),
        "command": " ".join(["scripts/bench_offload_delayed.py", *(argv if argv is not None else sys.argv[1:])]),
        "smoke": args.smoke,
        "fields": {**COMMON, **preset},
        "load_average_before": os.getloadavg(),
        "runs": {},
    }
    for name, fields in RUNS.items():
        print(f"offload_delayed: {name} ...", flush=True)
        result["runs"][name] = run(name, {**COMMON, **preset, **fields}, work / name.replace(" + ", "_"))
    result["load_average_after"] = os.getloadavg()
    print(publish(out, result, render_markdown(result)))
    return 0


def render_markdown(r: dict) -> str:
    m, fields, runs = r["machine"], r["fields"], r["runs"]
    load = load_averages(r)
    exact = runs["after_backward"]
    size = max(1, len(exact["loss"]) // 6)
    lines = [
        "# Granular offload: the delayed update's cost in loss"
        + (" — smoke run (checks the script; not a result)" * r["smoke"]),
        "",
        f"Produced by `python {r['command']}` on {r['date']}. Machine: {m['cpu_count']} CPUs ({m['cpu']}), torch "
        f"{m['torch']}; load average (1, 5, 15 min) before / after: {load}. The trainer on CPU: a real model of "
        f"{fields['num_hidden_layers']} layers (hidden {fields['hidden_size']}), {fields['real_steps']} steps of "
        f"{fields['gradient_accumulation_steps']} x {fields['per_device_batch_size']} x {fields['block_size']} tokens, "
        f"offload {fields['offload']} with the gradients summed on the device, seed {fields['seed']}.",
        "",
        f"Training loss, mean over windows of {size} logged steps (every {fields['logging_steps']} steps):",
        "",
        "| up to step | " + " | ".join(runs) + " |",
        "|---:|" + "---:|" * len(runs),
    ]
    table = {name: dict(windows(run["loss"], size)) for name, run in runs.items()}
    for step in table["after_backward"]:
        lines.append(f"| {step} | " + " | ".join(f"{table[name].get(step, float('nan')):.4f}" for name in runs) + " |")
    lines += ["", "Validation loss:", "", "| step | " + " | ".join(runs) + " |", "|---:|" + "---:|" * len(runs)]
    for step in sorted(exact["val_loss"], key=int):
        cells = [f"{run['val_loss'].get(step, float('nan')):.4f}" for run in runs.values()]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    last = max(exact["val_loss"], key=int)
    base = exact["val_loss"][last]
    verdict = []
    for name, run in runs.items():
        if name != "after_backward":
            difference = run["val_loss"][last] - base
            verdict.append(f"{name}: {difference:+.4f} ({difference / base:+.2%})")
    lines += [
        "",
        f"Final validation loss against the exact update (step {last}): " + "; ".join(verdict) + ". The exact "
        "update stays the default; the delayed one is an option whose step-time gain a GPU run measures "
        "(`make gpu-report`).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
