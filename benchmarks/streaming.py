"""A streaming run against a map-style run of the demo on the same data (issue 37 point 7).

The demo's corpus (the standard-library sources of `configs/demo.yaml`, `corpus_max_bytes` 1,000,000) is written as
JSON lines: training shards and a held-out validation file. The demo's schedule then runs twice per round through
`scripts/train.py` in fresh processes, map-style (`--train_files` the shards) and streaming (`--streaming true`, the
same shards, `--validation_files` the held-out file), each with its own empty datasets cache (so the map-style run
tokenizes its corpus as a first run does), in interleaved rounds. Each run's wall time and CPU time (user + system of
the process and its children) are recorded; the ratios streaming / map-style are per round, then the median.

It also times the data path alone (no model): the blocks of the demo's steps read map-style (`build_blocks`, then
`BlockOrder` indexing) and streaming (`stream_blocks`, then `BlockStream.take`), in this process.

    python scripts/bench_streaming.py                          # writes benchmarks/streaming.{json,md}
    python scripts/bench_streaming.py --steps 20 --rounds 1 --out /tmp/s   # smoke run
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import REPO, machine, utc_now, write_json, write_text

COMMAND = "python scripts/bench_streaming.py"
SHARDS = 4


def write_corpus(folder: Path, corpus_max_bytes: int) -> tuple[list[str], list[str]]:
    """The demo's corpus as JSON lines: every 20th document held out into validation.jsonl, the others dealt into
    `SHARDS` training shards. Returns (training shards, validation files)."""
    from hf_p2r.training.data import stdlib_corpus

    texts = stdlib_corpus(corpus_max_bytes)["text"]
    held_out = [text for i, text in enumerate(texts) if i % 20 == 19]
    training = [text for i, text in enumerate(texts) if i % 20 != 19]
    shards = []
    for shard in range(SHARDS):
        path = folder / f"train-{shard:05d}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in training[shard::SHARDS]))
        shards.append(str(path))
    validation = folder / "validation.jsonl"
    validation.write_text("".join(json.dumps({"text": text}) + "\n" for text in held_out))
    return shards, [str(validation)]


def run_trainer(kind: str, shards: list[str], validation: list[str], scratch: Path, args) -> dict:
    """One demo run of `kind` (map-style or streaming) in a fresh process: its wall and CPU seconds."""
    output_dir = scratch / f"run-{kind}"
    argv = ["--config", "configs/demo.yaml", "--output_dir", str(output_dir), "--train_files", *shards]
    argv += ["--cache_dir", str(scratch / f"cache-{kind}-{time.monotonic_ns()}"), "--cpu", "true"]
    argv += ["--save_steps", "0", "--overwrite_output_dir", "true"]
    if args.steps is not None:
        pseudo = args.steps // 3
        argv += ["--pseudo_steps", str(pseudo), "--real_steps", str(args.steps - pseudo)]
        argv += ["--warmup_steps", str(min(20, args.steps // 4)), "--eval_steps", str(max(1, args.steps // 4))]
    if kind == "streaming":
        argv += ["--streaming", "true", "--validation_files", *validation]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    before, load_before = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "scripts/train.py", *argv], cwd=REPO, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        raise SystemExit(f"the {kind} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    val_loss = [json.loads(line).get("val_loss") for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "final_val_loss": [v for v in val_loss if v is not None][-1],
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def time_data_path(shards: list[str], validation: list[str], scratch: Path, blocks: int) -> dict:
    """Seconds to build and read `blocks` blocks of 128 tokens map-style, and streaming, in this process."""
    from hf_p2r.training.config import DataArguments
    from hf_p2r.training.data import build_blocks, byte_level_tokenizer, stream_blocks

    tokenizer, out = byte_level_tokenizer(), {}
    common = {"train_files": shards, "block_size": 128, "validation_fraction": 0.05}
    started = time.perf_counter()
    data = build_blocks(DataArguments(**common, cache_dir=str(scratch / "data-map")), tokenizer, seed=0)
    order = data.position(0)
    for start in range(0, blocks, 8):
        data.train[order.indices(start, 8)]["input_ids"]
    out["map_style_s"] = round(time.perf_counter() - started, 2)
    started = time.perf_counter()
    arguments = DataArguments(**common, streaming=True, validation_files=validation, cache_dir=str(scratch / "d-s"))
    stream = stream_blocks(arguments, tokenizer, 0, 1, eval_blocks=64).train
    for _ in range(0, blocks, 8):
        stream.take(8)
    out["streaming_s"] = round(time.perf_counter() - started, 2)
    return out


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.scratch) as folder:
        scratch = Path(folder)
        shards, validation = write_corpus(scratch, args.corpus_max_bytes)
        rounds = []
        for _ in range(args.rounds):
            rounds.append({kind: run_trainer(kind, shards, validation, scratch, args) for kind in ("map", "streaming")})
            print(json.dumps(rounds[-1]), flush=True)
        steps = args.steps if args.steps is not None else 240
        data_path = time_data_path(shards, validation, scratch, blocks=steps * 8)
    ratios = {
        key: statistics.median(r["streaming"][key] / r["map"][key] for r in rounds) for key in ("wall_s", "cpu_s")
    }
    return {
        "benchmark": "streaming",
        "command": COMMAND + " " + " ".join(sys.argv[1:]),
        "date": utc_now(),
        "machine": machine(),
        "corpus_max_bytes": args.corpus_max_bytes,
        "steps": args.steps if args.steps is not None else "the demo's (240)",
        "rounds": rounds,
        "median_ratio_streaming_over_map": {key: round(value, 3) for key, value in ratios.items()},
        "data_path_only": data_path,
        "target": "streaming CPU time <= 1.5x map-style",
    }


def markdown(result: dict) -> str:
    lines = [
        "# Streaming against map-style: the demo on the same data",
        "",
        f"Written by `{result['command'].strip()}` on {result['date']}; {result['machine']['cpu']}, "
        f"{result['machine']['cpu_count']} cores, Python {result['machine']['python']}, torch "
        f"{result['machine']['torch']}. Load average (1 min) before/after each run is in the table: the machine is "
        "shared, so the figures are only as quiet as it was.",
        "",
        f"The demo's corpus ({result['corpus_max_bytes']:,} bytes of standard-library sources) as {SHARDS} JSON-lines "
        "shards plus a held-out file; the demo's configuration, steps: "
        f"{result['steps']}; each run a fresh `scripts/train.py` process with an empty datasets cache.",
        "",
        "| round | run | wall s | CPU s | final val_loss | load before/after |",
        "|---|---|---|---|---|---|",
    ]
    for number, round_ in enumerate(result["rounds"], 1):
        for kind, run in round_.items():
            load = "/".join(f"{value:.1f}" for value in run["load_average"])
            lines.append(
                f"| {number} | {kind} | {run['wall_s']:.1f} | {run['cpu_s']:.1f} | {run['final_val_loss']:.4f} | "
                f"{load} |"
            )
    ratio = result["median_ratio_streaming_over_map"]
    data = result["data_path_only"]
    lines += [
        "",
        f"**Streaming / map-style (median over rounds): CPU time {ratio['cpu_s']:.2f}x, wall time "
        f"{ratio['wall_s']:.2f}x** (target: {result['target']}).",
        "",
        f"The data path alone (no model, this process): the demo's blocks read map-style in {data['map_style_s']:.1f} "
        f"s (tokenizing the corpus included), streaming in {data['streaming_s']:.1f} s.",
        "",
        "The validation losses differ by design: map-style holds out 5% of the shards' text by document, streaming "
        "evaluates on the held-out file.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per run (default: the demo's).")
    parser.add_argument("--corpus_max_bytes", type=int, default=1_000_000)
    parser.add_argument("--scratch", default=None, help="Folder for the data and runs (default: the system's temp).")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "streaming")
    args = parser.parse_args(argv)
    result = measure(args)
    write_json(args.out.with_suffix(".json"), result)
    write_text(args.out.with_suffix(".md"), markdown(result))
    print(markdown(result))
    return 0
