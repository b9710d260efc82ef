"""The trainer's malloc setting (issue 37, item 9): peak host memory per process of a 4-process FSDP2 run with the
trainer's own setting (no environment variable: `hf_p2r.train.set_malloc` fixes glibc's mmap threshold at start),
with `MALLOC_MMAP_THRESHOLD_=131072` in the environment (what the scale benchmark set by hand), and with glibc's
default (`HF_P2R_MALLOC=glibc`), side by side in one run.

    python -m benchmarks.malloc                      # benchmarks/malloc.{json,md}; ~10 min on 2 CPU cores

The method is benchmarks/scale.py's (its `launch`: the trainer under `torchrun` on gloo, one thread per process, each
process's peak VmHWM), on its "4 sharded (FSDP2)" layout, for its tiny model (the baseline: Python, torch, gloo, the
corpus) and its 55M-parameter w512-L16; bytes per parameter = (peak - the same setting's tiny peak) / P.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, scale
from benchmarks.harness import REPO, write_json, write_text

LAYOUT = "4 sharded (FSDP2)"
MODELS = ("tiny", "w512-L16")
SETTINGS = {
    "trainer": {},  # nothing in the environment: the trainer's own setting
    "environment": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    "glibc": {"HF_P2R_MALLOC": "glibc"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "malloc"), help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    scale.ALLOCATORS.update(SETTINGS)
    report = {"date": scale.now(), "machine": {**harness.machine(), "load_average_start": os.getloadavg()}}
    report["command"] = "python -m benchmarks.malloc " + " ".join(argv or sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in MODELS:
            params = scale.parameters(scale.MODELS[name])
            for setting in SETTINGS:
                started = time.perf_counter()
                row, _ = scale.run_layout(Path(workdir), name, LAYOUT, params, setting)
                row["wall_s"] = time.perf_counter() - started
                rows.append(row)
    tiny = {row["allocator"]: row["peak_bytes_max"] for row in rows if row["model"] == "tiny"}
    for row in rows:
        if row["model"] != "tiny":
            row["bytes_per_parameter_above_tiny"] = (row["peak_bytes_max"] - tiny[row["allocator"]]) / row["parameters"]
    report["load_average_end"] = os.getloadavg()
    report["rows"] = rows
    write_json(Path(f"{args.out}.json"), report)
    write_text(Path(f"{args.out}.md"), render(report))
    print(render(report))
    return 0


def render(report: dict) -> str:
    machine = report["machine"]
    load = f"load average {report['machine']['load_average_start'][0]:.1f} at the start, "
    load += f"{report['load_average_end'][0]:.1f} at the end"
    lines = [
        "# The trainer's malloc setting: host memory per process, 4 FSDP2 processes",
        "",
        f"{report['date']}, {machine['cpu']} ({machine['cpu_count']} cores), torch {machine['torch']}, Python "
        f"{machine['python']}; {load} (other work shared the cores: memory is not affected). Command: "
        f"`{report['command']}`.",
        "",
        "Each row is the trainer under `torchrun` (4 processes, gloo, FSDP2 over the whole model: `data_parallel_size "
        "4`, `data_parallel_shard true`) through scale.py's schedule (pseudo stage, delink, real stage, DCP "
        "checkpoints); *peak* is the highest process's VmHWM, *above tiny* subtracts the same setting's run of the "
        "tiny model. *trainer*: no variable set, the trainer fixes glibc's mmap threshold at 128 KiB itself at start "
        "(`mallopt`); *environment*: `MALLOC_MMAP_THRESHOLD_=131072` (the trainer then leaves malloc alone); *glibc*: "
        "`HF_P2R_MALLOC=glibc`, glibc's default (its threshold rises to the largest block freed, up to 32 MiB).",
        "",
        "| model | P | malloc | peak/process MiB | above tiny MiB | bytes/parameter above tiny |",
        "|---|---:|---|---:|---:|---:|",
    ]
    tiny = {row["allocator"]: row["peak_bytes_max"] for row in report["rows"] if row["model"] == "tiny"}
    for row in report["rows"]:
        above = row["peak_bytes_max"] - tiny[row["allocator"]]
        per = row.get("bytes_per_parameter_above_tiny")
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e6:.1f}M | {row['allocator']} | "
            f"{row['peak_bytes_max'] / 2**20:,.0f} | {'' if row['model'] == 'tiny' else f'{above / 2**20:,.0f}'} | "
            f"{'' if per is None else f'{per:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
