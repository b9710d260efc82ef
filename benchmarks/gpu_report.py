"""One command that measures hf-p2r on one GPU (issue 29): the GPU tests, throughput and MFU (eager and compiled),
the loss path's memory, offload by ratio and design against FSDP2's CPUOffloadPolicy, where the offloaded step's time
goes (issue 40: a `torch.profiler` trace of a few steps at ratio 0.5 per design, summarised in
`OUT/offload_profile.md`), a bf16 trainer run with `offload: auto` through the delink, and (issue 25) the trainer under
Accelerate's FSDP2 config with DCP checkpoints, a resume and `hf-p2r export`. It writes `OUT/<part>.json` for each
part and `OUT/report.md`, a page that names the device and says, for each of issue 29's and 40's targets, met,
missed or not measured; a run into benchmarks/gpu also rewrites benchmarks/offload.md from its offload results.

    make gpu-report                                  # = python scripts/gpu_report.py: one CUDA GPU, < 18 min
    make gpu-report DRY=1                            # = --dry-run: every part at tiny size on CPU (about a minute)
    python scripts/gpu_report.py --parts throughput,offload --out /tmp/g
    python scripts/gpu_report.py --budget 540        # the parts in order, all within 9 minutes (others skipped)
    python scripts/gpu_report.py --page RUN/report.json ...  # one page of several runs' parts (the latest of each)

Each part runs as its own process (a failing or hanging part is recorded, with its output's tail, and the next one
runs) under a time limit (`PARTS`: 18 minutes in all; `--budget` bounds the whole). The parts reuse the project's
benchmarks through their command lines (`benchmarks/throughput.py`'s runners, `benchmarks/loss_memory.py`,
`benchmarks/offload.py`) and the trainer (`python -m hf_p2r.train`). The dry run (the test suite runs it) checks the
commands, not the machine: its figures are not results.

On a GPU machine, after `source .gpu/device-setup.sh` (../shared/gpu/device-setup.sh: the wheels the machine lacks),
`python scripts/gpu_report.py` needs nothing else; it refuses to start without CUDA (use --dry-run).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import presets
from benchmarks.gpu_convergence import part_convergence
from benchmarks.harness import REPO, machine, utc_now, write_json, write_text

# Dense bf16 peak FLOP/s (no sparsity) of the GPUs MFU is computed for, by a name fragment of
# torch.cuda.get_device_name(): NVIDIA's datasheets (H100 SXM and H200: 989.4 TFLOP/s; A100: 312).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Issue 29's targets and issue 40's offload targets (the best offload design's), as the page reports them.
TARGETS = {
    "mfu_compiled": 0.40,
    "pseudo_vs_real": 0.98,
    "offload_0.5_vs_none": 0.85,
    "offload_1.0_vs_none": 0.6,
    "full_offload_vs_fsdp2": 3.0,
}

# (part, time limit in seconds on the GPU, on the dry run). The GPU limits add up to 1,080 s: more than one lending of a
# GPU, so a run names its parts or a --budget. Measured on an H200: on 2026-11-26 (benchmarks/gpu/2026-11-26/,
# benchmarks/gpu/rerun-2026-11-26/) loss_memory 102 s and fsdp2_dcp 84; on 2026-11-28 (benchmarks/gpu/2026-11-28/)
# offload_profile 72, convergence 91, offload 186 (4 designs x 3 ratios, no offload and FSDP2), throughput 83, trainer
# 112 and tests 82. The dry run's limits only guard against a hang (its parts take 5-60 s each on two idle cores).
PARTS = {
    "tests": (90, 180),
    "throughput": (110, 180),
    "loss_memory": (130, 180),
    "offload_profile": (90, 180),  # issue 40: the profile first, then the designs' throughput
    "offload": (240, 300),
    "trainer": (120, 180),
    "fsdp2_dcp": (120, 300),
    "convergence": (180, 600),  # issue 39: benchmarks/gpu_convergence.py
}

# The dry run's trainer parts: a CPU run needs a budget for `offload: auto` (the pseudo model fits, the real one
# offloads a block).
TINY_TRAINER = {
    **presets.TINY_RUN,
    **presets.schedule(warmup=1, log_every=1, eval_every=2, eval_blocks=4),
    "num_unique_layers": 1,
    "pseudo_steps": 2,
    "real_steps": 2,
    "offload_budget_gb": 0.002,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every part at tiny size on CPU (checks the commands)")
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/gpu; dry run: a temporary one)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for all the parts together (a GPU lent for a few minutes): each part runs under the smaller of "
        "its limit and what is left, in the order of --parts; a part with under 30 s left is skipped",
    )
    parser.add_argument(
        "--page",
        nargs="+",
        type=Path,
        metavar="REPORT_JSON",
        help="measure nothing: write OUT/report.md and report.json from these runs' report.json (a GPU lent twice "
        "for a few minutes runs some parts each time; a later run's part replaces an earlier one's), the targets read "
        "from the parts' records in OUT (copy each part's latest <part>.json there first: a record of another run is "
        "refused)",
    )
    parser.add_argument("--worker", choices=["throughput"], help=argparse.SUPPRESS)  # one part, in its own process
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.worker:
        return throughput_worker(args.out, device)
    if args.page:
        return write_page(args.page, args.out or REPO / "benchmarks" / "gpu")
    parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"gpu_report: --parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_report: needs a CUDA GPU and none is available (--dry-run checks the commands on CPU)", file=sys.stderr
        )
        return 1
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_report_")) if args.dry_run else REPO / "benchmarks" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": utc_now(), "machine": machine(), "dry_run": args.dry_run, "device": device_name(), "parts": {}}
    started = time.perf_counter()
    for part in parts:
        limit = PARTS[part][1 if args.dry_run else 0]
        if args.budget is not None:
            limit = min(limit, round(args.budget - (time.perf_counter() - started)))
            if limit < 30:
                report["parts"][part] = {"status": "skipped", "seconds": 0.0, "command": "(over --budget)"}
                print(f"gpu_report: {part}: skipped (--budget {args.budget:.0f} s spent)", flush=True)
                continue
        print(f"gpu_report: {part} (limit {limit} s) ...", flush=True)
        record = RUNNERS[part](out, args.dry_run, limit)
        report["parts"][part] = {key: value for key, value in record.items() if key != "result"}
        write_json(out / f"{part}.json", record)
        print(f"gpu_report: {part}: {record['status']} in {record['seconds']:.0f} s", flush=True)
    report["seconds"] = time.perf_counter() - started
    report["targets"] = targets(out)
    if not args.dry_run and out.resolve() == (REPO / "benchmarks" / "gpu").resolve() and "offload" in parts:
        page = run([sys.executable, "scripts/bench_offload.py", "--page"], 60)  # benchmarks/offload.md: the latest
        print(f"gpu_report: benchmarks/offload.md: {page['status']}", flush=True)
    write_report(report, out)
    return 0 if all(p["status"] in ("ok", "skipped") for p in report["parts"].values()) else 1


def write_report(report: dict, out: Path) -> None:
    """OUT/report.json and OUT/report.md, with the FSDP2 + DCP and convergence results from their parts' records."""
    for part in ("fsdp2_dcp", "convergence"):
        report[part] = ((read_json(out / f"{part}.json") or {}).get("result") or {}) or None
    write_json(out / "report.json", report)
    page = render_markdown(report)
    write_text(out / "report.md", page)
    print(page)
    print(f"gpu_report: wrote {out}")


def write_page(paths: list[Path], out: Path) -> int:
    """`--page`: one report of several runs' parts (in the order given, a later run's part replacing an earlier one's;
    skipped parts replace nothing), each part with the date of the run it comes from."""
    runs = []
    for path in paths:
        found = read_json(path)
        if not isinstance(found, dict) or not isinstance(found.get("parts"), dict) or found.get("dry_run"):
            print(f"gpu_report: --page: {path}: not the report.json of a GPU run", file=sys.stderr)
            return 2
        runs.append((path, found))
    parts = {}
    for _, found in runs:
        for name, part in found["parts"].items():
            if part["status"] != "skipped":
                parts[name] = {**part, "date": found["date"]}
    for name, part in parts.items():  # the targets come from OUT's records: each must be the run's own
        record = read_json(out / f"{name}.json") or {}
        if record.get("command") != part.get("command"):
            print(
                f"gpu_report: --page: {out / f'{name}.json'} is not the record of the {part['date']} run's {name} part "
                "(another command): copy that run's one there",
                file=sys.stderr,
            )
            return 2
    newest = max((found for _, found in runs), key=lambda found: found["date"])
    report = {
        "date": newest["date"],
        "machine": newest["machine"],
        "dry_run": False,
        "device": newest["device"],
        "parts": parts,
        "runs": [
            {"report": _shown(path), "date": found["date"], "device": found["device"], "seconds": found["seconds"]}
            for path, found in runs
        ],
        "seconds": sum(found["seconds"] for _, found in runs),
        "targets": targets(out),
    }
    write_report(report, out)
    return 0


def _shown(path: Path) -> str:
    """`path` relative to the repository where it is inside it (a page names files by where they are in the repo)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from benchmarks.harness import cpu_name

    return f"CPU: {cpu_name()}"


def run(command: list[str], limit: int, env: dict | None = None) -> dict:
    """`command` in the repository root, its output captured, killed after `limit` seconds: {status (ok, failed,
    timeout), returncode, seconds, command, output_tail}."""
    started = time.perf_counter()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            command, cwd=REPO, env={**environment, **(env or {})}, capture_output=True, text=True, timeout=limit
        )
        status, code, output = ("ok" if done.returncode == 0 else "failed"), done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        status, code = "timeout", None
        output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (error.stdout, error.stderr))
    return {
        "status": status,
        "returncode": code,
        "seconds": time.perf_counter() - started,
        "command": " ".join(command[1:] if command[0] == sys.executable else command),
        "output_tail": output[-4000:],
    }


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- the parts ----------------------------------------------------------------------------------------------------
def part_tests(out: Path, dry: bool, limit: int) -> dict:
    """`pytest -m gpu`, then the CUDA tests without the marker (offload's device tests: `-k cuda`). Dry run: the
    marked tests of tests/ops collected, not run (on CPU they skip; collecting the whole suite twice would take longer
    than every other part of the dry run)."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if dry:
        record = run([*pytest, "--collect-only", "-m", "gpu", "tests/ops"], limit)
        record["marked_summary"] = _summary(record)
        return record
    marked = run([*pytest, "-m", "gpu"], limit)
    rest = run(
        [*pytest, "tests/training/test_offload.py", "-k", "cuda", "-m", "not gpu"],
        max(limit - round(marked["seconds"]), 1),
    )
    record = {
        **marked,
        "unmarked_cuda_tests": rest,
        "marked_summary": _summary(marked),
        "unmarked_summary": _summary(rest),
    }
    record["status"] = marked["status"] if marked["status"] != "ok" else rest["status"]
    record["seconds"] = marked["seconds"] + rest["seconds"]
    return record


def _summary(result: dict) -> str | None:
    """pytest's last summary line ("3 passed, 2 skipped in 9.1s")."""
    pattern = r"\d+ (passed|failed|skipped|errors?|tests? collected|deselected)"
    lines = [line for line in result["output_tail"].splitlines() if re.search(pattern, line)]
    return lines[-1].strip("= ") if lines else None


def part_throughput(out: Path, dry: bool, limit: int) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "throughput",
        "--out",
        str(out / "throughput_runs"),
    ]
    record = run([*command, *(["--dry-run"] if dry else [])], limit)
    record["result"] = read_json(out / "throughput_runs" / "throughput.json")
    return record


def part_loss_memory(out: Path, dry: bool, limit: int) -> dict:
    options = ["--smoke"] if dry else ["--device", "cuda"]
    record = run(
        [sys.executable, "scripts/bench_loss_memory.py", *options, "--out", str(out / "loss_memory_run")], limit
    )
    record["result"] = read_json(out / "loss_memory_run.json")
    return record


def part_offload(out: Path, dry: bool, limit: int) -> dict:
    """`benchmarks/offload.py --part throughput` over its REPORT_DESIGNS at ratios 0.25, 0.5 and 1.0 (the dry run: 0.5
    and 1.0), beside no offload and FSDP2's CPUOffloadPolicy, in one process (one run: `designs` keeps the part's
    former shape)."""
    command = [sys.executable, "scripts/bench_offload.py", "--part", "throughput", "--designs", "report"]
    command += ["--device", "cpu", "--smoke"] if dry else ["--device", "cuda"]
    command += ["--ratios", "0.5,1.0" if dry else "0.25,0.5,1.0"]
    target = out / "offload_report"
    result = run([*command, "--out", str(target)], limit)
    result["result"] = read_json(target.with_suffix(".json"))
    return {"status": result["status"], "seconds": result["seconds"], "designs": {"report": result},
            "command": result["command"]}  # fmt: skip


def part_offload_profile(out: Path, dry: bool, limit: int) -> dict:
    """`benchmarks/offload.py --part profile`: a `torch.profiler` trace of 2 steps at ratio 0.5 per design, summarised
    into `offload_profile.md` (where each millisecond goes) and `offload_profile_trace.json` (a small trace)."""
    command = [sys.executable, "scripts/bench_offload.py", "--part", "profile", "--out", str(out / "offload_profile")]
    record = run([*command, *(["--device", "cpu", "--smoke"] if dry else ["--device", "cuda"])], limit)
    record["result"] = read_json(out / "offload_profile.json")
    return record


def part_trainer(out: Path, dry: bool, limit: int) -> dict:
    """A bf16 trainer run with `offload: auto` through the delink, compiled, with the chunked (or Liger) loss: the
    demo's configuration on the GPU, a tiny one on CPU."""
    output_dir = out / "trainer_run"
    fields = {"mixed_precision": "bf16", "offload": "auto", "compile": "true", "loss_kernel": "auto"}
    fields.update(output_dir=str(output_dir), overwrite_output_dir="true", save_total_limit=1)
    if dry:
        fields.update(TINY_TRAINER, cpu="true", compile_backend="aot_eager")
        config = []
    else:
        config = ["--config", "configs/demo.yaml"]
    argv = [item for key, value in fields.items() for item in (f"--{key}", str(value))]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    record = run([sys.executable, "-m", "hf_p2r.train", *config, *argv], limit, env)
    records = [json.loads(line) for line in _lines(output_dir / "metrics.jsonl")]
    record["result"] = {
        "delinks": [
            {k: r.get(k) for k in ("step", "num_blocks_before", "num_blocks", "offloaded_blocks")}
            for r in records
            if r.get("event") == "delink"
        ],
        "last": next((r for r in reversed(records) if "val_loss" in r), None),
        "tokens_per_s": [r["tokens_per_s"] for r in records if "tokens_per_s" in r][-1:],
    }
    return record


def part_fsdp2_dcp(out: Path, dry: bool, limit: int) -> dict:
    """Issue 25 on the GPU: the trainer under `accelerate launch --config_file configs/accelerate/fsdp2.yaml` with one
    process (FSDP2 over NCCL, bf16; on CPU Accelerate runs it unsharded) through pseudo -> delink -> real with DCP
    checkpoints; a second run resumed from the real stage's middle checkpoint, whose losses are compared with the
    uninterrupted run's; and `hf-p2r export` of the last checkpoint to a Llama folder, whose logits are compared with
    the trainer's `real/` folder (on the CPU, fp32)."""
    pseudo, real = (2, 2) if dry else (20, 20)
    middle, last = pseudo + real // 2, pseudo + real
    fields = dict(pseudo_steps=pseudo, real_steps=real, save_steps=real // 2, checkpoint_format="dcp")
    fields.update(
        partial_delink_blocks="[]", warmup_steps=1, eval_steps=real, logging_steps=1, overwrite_output_dir="true"
    )
    if dry:
        fields.update(
            {k: v for k, v in TINY_TRAINER.items() if k not in fields and k not in ("offload_budget_gb", "cpu")}
        )
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/fsdp2.yaml"]
    launch += ["--num_processes", "1", *(["--cpu", "--mixed_precision", "no"] if dry else [])]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = {"uninterrupted": out / "fsdp2_run", "resumed": out / "fsdp2_resumed"}
    record = {"status": "ok", "seconds": 0.0, "steps": {}}
    started = time.perf_counter()
    for name, folder in runs.items():
        argv = [item for key, value in {**fields, "output_dir": folder}.items() for item in (f"--{key}", str(value))]
        if name == "resumed":
            argv += ["--resume_from_checkpoint", str(runs["uninterrupted"] / "checkpoints" / f"checkpoint-{middle}")]
        result = run([*launch, "scripts/train.py", "--config", "configs/demo.yaml", *argv], _left(limit, started), env)
        record["steps"][name] = result
        if result["status"] != "ok":
            record.update(status=result["status"], output_tail=result["output_tail"])
            break
    if record["status"] == "ok":
        exported = out / "fsdp2_llama"
        checkpoint = runs["uninterrupted"] / "checkpoints" / f"checkpoint-{last}"
        command = [sys.executable, "-m", "hf_p2r.cli", "export", str(checkpoint), str(exported), "--target", "llama"]
        result = run([*command, "--overwrite"], _left(limit, started), env)
        record["steps"]["export"] = result
        if result["status"] != "ok":
            record.update(status=result["status"], output_tail=result["output_tail"])
        else:
            record["result"] = _compare_fsdp2_runs(runs, middle, runs["uninterrupted"] / "real", exported)
    record["seconds"] = time.perf_counter() - started
    record["command"] = "; ".join(step["command"] for step in record["steps"].values())
    return record


def _left(limit: int, started: float) -> int:
    return max(round(limit - (time.perf_counter() - started)), 1)


def _compare_fsdp2_runs(runs: dict[str, Path], middle: int, real: Path, exported: Path) -> dict:
    """The resumed run's training losses against the uninterrupted run's after the checkpoint, and the exported Llama
    folder's logits against the trainer's `real/` folder on one batch (CPU, fp32)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import hf_p2r  # noqa: F401  (registers P2R with the Auto classes: `real/` loads through AutoModelForCausalLM)

    losses = {
        name: {r["step"]: r["loss"] for r in map(json.loads, _lines(folder / "metrics.jsonl")) if "loss" in r}
        for name, folder in runs.items()
    }
    steps = sorted(step for step in losses["resumed"] if step > middle and step in losses["uninterrupted"])
    differences = [abs(losses["resumed"][s] - losses["uninterrupted"][s]) for s in steps]
    p2r = AutoModelForCausalLM.from_pretrained(real, trust_remote_code=True, dtype=torch.float32).eval()
    llama = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    batch = torch.randint(3, p2r.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = (p2r(batch).logits - llama(batch).logits).abs().max().item()
    return {
        "resume_steps_compared": steps,
        "resume_max_abs_loss_difference": max(differences) if differences else None,
        "resume_losses": {name: [losses[name].get(s) for s in steps] for name in losses},
        "export_max_abs_logit_difference": logits,
        "delinks": [r for r in map(json.loads, _lines(runs["uninterrupted"] / "metrics.jsonl")) if r.get("event")],
    }


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


RUNNERS = {
    "tests": part_tests,
    "throughput": part_throughput,
    "loss_memory": part_loss_memory,
    "offload_profile": part_offload_profile,
    "offload": part_offload,
    "trainer": part_trainer,
    "fsdp2_dcp": part_fsdp2_dcp,
    "convergence": part_convergence,
}


# --- the throughput worker ----------------------------------------------------------------------------------------
def throughput_worker(out: Path, device: str) -> int:
    """benchmarks/throughput.py's three runners (Llama, P2R real, P2R pseudo k=1; its GPU preset, bf16 autocast,
    sdpa), eager and then with every decoder block compiled (`compile_blocks`, inductor on the GPU, aot_eager on the
    dry run), each with MFU: tokens/s x training FLOPs per token (the model inventory's: 6 per parameter of the
    matrices, attention scores, the head) / the GPU's dense bf16 peak."""
    from benchmarks import throughput
    from hf_p2r import P2RConfig
    from hf_p2r.models.p2r.inventory_p2r import inventory
    from hf_p2r.training.compile import compile_blocks

    dry = device == "cpu"
    table = {"tiny": throughput.PRESETS["tiny"], "cuda": throughput.PRESETS["cuda"]}
    rounds, steps, warmup = (1, 1, 1) if dry else (4, 3, 2)
    argv = ["--device", device, "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup)]
    args = throughput.command_line(throughput.__doc__, table, str(out), rounds, steps, warmup).parse_args(
        [*argv, *(["--preset", "tiny"] if dry else [])]
    )
    fields, batch, autocast_dtype = throughput.prepare(args, table, "gpu_report")
    dims = dict(fields, max_position_embeddings=batch.shape[1], tie_word_embeddings=False)
    flops_per_token = inventory(P2RConfig(**dims)).flops(batch.shape[1])
    peak = next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in device_name()), None)
    results = {}
    for mode in ("eager", "compiled"):
        runners = build_runners(throughput, dims, batch, device, autocast_dtype, args.num_unique_layers)
        if mode == "compiled":
            for runner in runners:
                compile_blocks(runner.model, "aot_eager" if dry else "inductor")
        result = throughput.measure(runners, args, dims, mode=mode)
        result["flops_per_token"] = flops_per_token
        result["peak_flops"] = peak
        result["mfu"] = {
            name: (rate * flops_per_token / peak if peak else None)
            for name, rate in result["tokens_per_s_median"].items()
        }
        results[mode] = result
        del runners
        if device == "cuda":
            torch.cuda.empty_cache()
    write_json(out / "throughput.json", results)
    return 0


def build_runners(throughput, dims, batch, device, autocast_dtype, num_unique_layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.harness import Runner
    from hf_p2r import P2RConfig, P2RForCausalLM

    torch.manual_seed(0)
    # No KV cache in training (as the trainer): compiled, its update would specialise each block on its depth.
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**dims, use_cache=False)),
        "p2r_real": P2RForCausalLM(P2RConfig(**dims, use_cache=False)),
        "p2r_pseudo": P2RForCausalLM(
            P2RConfig(**dims, use_cache=False, share_layers=True, num_unique_layers=num_unique_layers)
        ),
    }
    return [Runner(name, model, batch, device, autocast_dtype) for name, model in models.items()]


# --- the page -----------------------------------------------------------------------------------------------------
def targets(out: Path) -> dict:
    """Issue 29's targets from the parts' results: {name: {target, measured, met}} (measured None: not measured)."""
    found = {name: {"target": value, "measured": None, "met": None} for name, value in TARGETS.items()}
    throughput = (read_json(out / "throughput.json") or {}).get("result") or {}
    compiled = throughput.get("compiled") or {}
    if compiled.get("mfu", {}).get("p2r_real") is not None:
        found["mfu_compiled"]["measured"] = compiled["mfu"]["p2r_real"]
    if compiled.get("ratio_pseudo_vs_real"):
        found["pseudo_vs_real"]["measured"] = compiled["ratio_pseudo_vs_real"]["median"]
    # The offload targets: the best design (rows "granular ratio R" for the host step, "granular ratio R <design>"
    # for another, in one run or one run per design), its name kept.
    offload = read_json(out / "offload.json") or {}
    if offload.get("designs"):
        from benchmarks.offload import design_of  # (here: it imports the model and offload packages)
    for design in (offload.get("designs") or {}).values():
        runs = ((design.get("result") or {}).get("throughput") or {}).get("runs") or {}
        fsdp2 = runs.get("fsdp2 CPUOffloadPolicy")
        for name, run in runs.items():
            if not name.startswith("granular ratio "):
                continue
            ratio, which = name.split()[2], design_of(name)
            if ratio in ("0.5", "1.0"):
                _best(found[f"offload_{ratio}_vs_none"], run["vs_no_offload"], which)
            if ratio == "1.0" and fsdp2:
                _best(found["full_offload_vs_fsdp2"], run["tokens_per_s"] / fsdp2["tokens_per_s"], which)
    for value in found.values():
        if value["measured"] is not None:
            value["met"] = value["measured"] >= value["target"]
    return found


def _best(target: dict, value: float, design: str) -> None:
    if target["measured"] is None or value > target["measured"]:
        target["measured"], target["design"] = value, design


def render_markdown(report: dict) -> str:
    m = report["machine"]
    dry = report["dry_run"]
    runs = report.get("runs")
    if runs:
        produced = (
            f"Written by `python scripts/gpu_report.py --page {' '.join(run['report'] for run in runs)}` from "
            f"{len(runs)} runs of `python scripts/gpu_report.py` (each part from the latest run that ran it): "
            + "; ".join(f"{run['date']}, {run['device']}, {run['seconds']:.0f} s (`{run['report']}`)" for run in runs)
            + f". Latest run's machine: {m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}, {m['platform']}."
        )
    else:
        produced = (
            f"Produced by `python scripts/gpu_report.py{' --dry-run' * dry}` on {report['date']} in "
            f"{report['seconds']:.0f} s; {m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}, {m['platform']}."
        )
    lines = [
        "# GPU report" + (" — dry run on CPU (checks the commands; not a result)" if dry else ""),
        "",
        f"Device: **{report['device']}**. {produced}",
        "",
        "| part | status | seconds | command |" + (" run |" if runs else ""),
        "|---|---|---:|---|" + ("---|" if runs else ""),
        *(
            f"| {name} | {part['status']} | {part['seconds']:.0f} | `{part.get('command', '')}` |"
            + (f" {part['date']} |" if runs else "")
            for name, part in report["parts"].items()
        ),
        "",
        "| target (issues 29, 40) | target | measured | met |",
        "|---|---:|---:|---|",
    ]
    for name, value in report["targets"].items():
        measured = "not measured" if value["measured"] is None else f"{value['measured']:.3f}"
        if "design" in value:
            measured += f" ({value['design']})"
        met = {None: "—", True: "met", False: "missed"}[value["met"]] if not dry else "— (dry run)"
        lines.append(f"| {name} | {value['target']} | {measured} | {met} |")
    fsdp2 = report.get("fsdp2_dcp")
    if fsdp2:
        lines += [
            "",
            "Issue 25, FSDP2 through `accelerate launch` on one process with DCP checkpoints: the run resumed from the "
            f"real stage's middle checkpoint differs from the uninterrupted one by at most "
            f"{fsdp2['resume_max_abs_loss_difference']:.3g} in loss over steps {fsdp2['resume_steps_compared']}; "
            f"`hf-p2r export --target llama` of its last checkpoint differs from its `real/` folder by at most "
            f"{fsdp2['export_max_abs_logit_difference']:.3g} in logits (fp32, CPU).",
        ]
    convergence = report.get("convergence")
    if convergence and len(convergence.get("runs") or ()) == 2:
        scratch, grown = convergence["runs"]
        reached = (
            f"reached scratch's final loss at {grown['flops_to_target']:.3g} FLOPs ({grown['speedup_flops']:.2f}x less)"
            if grown.get("flops_to_target")
            else f"ended {grown['final_val_loss'] - scratch['final_val_loss']:+.4f} above scratch's final loss"
        )
        lines += [
            "",
            f"Issue 39, growth at GPU scale ({convergence['parameters'] / 1e6:.1f}M parameters, "
            f"{convergence['steps']} steps each, the same {scratch['tokens']:,} tokens): scratch's final validation "
            f"loss {scratch['final_val_loss']:.4f} at {scratch['flops']:.3g} FLOPs; `{grown['name']}` spent "
            f"{grown['budget_ratio']:.2f} of those FLOPs, its final loss {grown['final_val_loss']:.4f}: it {reached} "
            "(both curves in `convergence.json`).",
        ]
    lines += ["", "Each part's figures, command and output tail: `<part>.json` beside this page."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
