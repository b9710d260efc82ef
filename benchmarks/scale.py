"""Scale: peak host memory and start-up time per process of the trainer against model size and process count, the
DCP checkpoint's save and load time against the one-process save, and a 4-process checkpoint resumed on 2 and on 1
process (issue 25's "no process ever holds a whole copy of the model").

    python scripts/bench_scale.py                          # benchmarks/scale.{json,md}; ~25 min on 2 CPU cores
    python scripts/bench_scale.py --quick --out /tmp/s     # smoke run (~1.5 min): 2 models, 1 and 2 processes

Every run is the trainer itself (`hf_p2r.train.main`, started by `torchrun` on gloo, one thread per process) through
pseudo stage (1 shared block) -> delink -> real stage -> DCP checkpoints -> `real/`, a few steps of a few short
sequences: memory is measured, not speed. A wrapper around the trainer (`--worker`, in each process) times the
engine's phases and reads the process's peak resident size (VmHWM of /proc/self/status, reset through
/proc/self/clear_refs at each phase boundary, so each phase's own peak is known too): start-up is launch to the first
training step; save and load are the engine's `write_checkpoint` (its part of a resume checkpoint) and `load`.

The bound checked per row (issue 25): peak RSS above the same layout's run of a tiny model <= 16 bytes per parameter
/ N processes (fp32 weights, gradients and AdamW's two moments, split N ways) + 2 bytes per parameter (half of one
fp32 copy: what a process may hold for a moment). The planner's per-process host figure
(`hf_p2r.planning.host_memory_per_process`) is printed beside it with its margin to the measurement.
"""

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, presets
from benchmarks.harness import REPO, free_port, write_json, write_text

MiB = 2**20
# One width, three depths (per-process memory against the number of layers), and a ~170M-parameter model (issue 25's).
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8)
MODELS = {
    "tiny": {k: v for k, v in presets.TINY.items() if k not in ("vocab_size", "num_key_value_heads")},
    "w512-L4": dict(WIDE, num_hidden_layers=4),
    "w512-L8": dict(WIDE, num_hidden_layers=8),
    "w512-L16": dict(WIDE, num_hidden_layers=16),
    "170M": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_hidden_layers=12),
}


def engine_layout(stages: int, replicas: int, sharded: bool, batch: int) -> dict:
    """A layout of the trainer's pipeline engine: `stages` x `replicas` processes, `batch` sequences per replica
    (split in 2 micro-batches where there are stages)."""
    fields = dict(
        pipeline_parallel_size=stages,
        data_parallel_size=replicas,
        data_parallel_shard=str(sharded).lower(),
        per_device_batch_size=batch,
    )
    if stages > 1:
        fields["num_microbatches"] = 2
    return dict(processes=stages * replicas, fields=fields)


# Each layout's trainer fields and process count; the global batch is 4 sequences where the layout allows it (a
# 1F1B pipeline needs as many micro-batches as stages: 2 per pipeline).
LAYOUTS = {
    # The layout fields given even where they are the defaults: a resume takes the saved run's layout otherwise.
    "1 process": dict(
        processes=1,
        fields=dict(
            per_device_batch_size=4, pipeline_parallel_size=1, data_parallel_size=1, data_parallel_shard="false"
        ),
    ),
    "4 sharded (FSDP2)": engine_layout(1, 4, True, 1),
    "4 = 2 stages x 2 sharded": engine_layout(2, 2, True, 2),
    "4 = 2 stages x 2 replicated": engine_layout(2, 2, False, 2),
    "8 = 2 stages x 4 sharded": engine_layout(2, 4, True, 2),
}
# The ~170M model runs where issue 25 asks (4 and 8 processes) and on one process (the save time's reference).
BIG_LAYOUTS = ("1 process", "4 sharded (FSDP2)", "8 = 2 stages x 4 sharded")
# pseudo steps 1-2 (1 block), the delink at step 2, real steps 3-5; a DCP checkpoint at step 3 and at the end.
SCHEDULE = {
    "num_unique_layers": 1,
    "pseudo_steps": 2,
    "real_steps": 3,
    "save_steps": 3,
    "checkpoint_format": "dcp",
    "block_size": 32,
    "corpus_max_bytes": 200_000,
    **presets.schedule(lr=1e-3, warmup=1, log_every=1, eval_every=0, eval_blocks=4),
    "save_total_limit": 10,
    "shared_lr_scale": "none",
    "cpu": "true",
}
# glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), so FSDP2's all-gathered
# blocks and AdamW's temporaries come from the heap afterwards and their freed pages stay resident: a fixed threshold
# keeps every block of 128 KiB and more in its own mapping, returned to the system when freed. The rows run with it
# (the setting the README gives for CPU runs); a few run with glibc's default for contrast.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
# (glibc's default needs HF_P2R_MALLOC=glibc: the trainer fixes the threshold itself otherwise, hf_p2r.train.set_malloc)
ALLOCATORS = {"fixed": FIXED_MMAP, "glibc": {"HF_P2R_MALLOC": "glibc"}}
CONTRAST = (("tiny", "4 sharded (FSDP2)"), ("w512-L16", "4 sharded (FSDP2)"))  # also run with glibc's default
RESUME_FROM = 3  # the real-stage checkpoint the other layouts resume
# Resumed layouts of the 4-process checkpoint, with the 4-process run's global batch of 4.
RESUMED_ON = {
    "2 sharded (FSDP2)": engine_layout(1, 2, True, 2),
    "2 = 2 stages": engine_layout(2, 1, False, 4),
    "1 process": LAYOUTS["1 process"],
}
# `--quick` (the test suite's smoke run: it checks the code, not the figures): the two models and layouts it runs, the
# sharded one on 2 processes (each process is a trainer's start-up: 2 fewer per sharded run than 4), resumed on 1.
QUICK = {"models": ["tiny", "w512-L4"], "layouts": ["1 process", "2 sharded (FSDP2)"], "resumed_on": ["1 process"]}
# Issue 25's bound: state share 16 bytes / parameter / N, plus 2 bytes / parameter.
STATE_BYTES_PER_PARAMETER, TRANSIENT_BYTES_PER_PARAMETER = 16, 2
# The resumed run's losses against the uninterrupted 4-process run's (relative): see the page for the measured value.
RESUME_RTOL = 1e-5


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


# --- in each trainer process ----------------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    """VmRSS, VmHWM (bytes) of this process."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


class Phases:
    """Peak resident bytes per phase of the run: at each boundary the peak so far is the ending phase's, then the
    kernel's peak is reset to the resident size (`/proc/self/clear_refs`, 5)."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, list[float]] = {}
        self.current = "start-up"
        self.first_step: float | None = None
        self.timeline: list[tuple[str, int, int]] = []  # (phase, its peak, the resident size at its end)

    def enter(self, name: str) -> None:
        status = _status()
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), status["VmHWM"])
        self.timeline.append((self.current, status["VmHWM"], status["VmRSS"]))
        Path("/proc/self/clear_refs").write_text("5")
        self.current = name

    def wrap(self, cls, method: str, phase: str) -> None:
        original = getattr(cls, method)
        phases = self

        def wrapper(engine, *args, **kwargs):
            if method == "forward_backward" and phases.first_step is None:
                phases.first_step = time.time()
            if phases.current == phase:  # (steps in a row)
                return original(engine, *args, **kwargs)
            phases.enter(phase)
            started = time.perf_counter()
            try:
                return original(engine, *args, **kwargs)
            finally:
                phases.seconds.setdefault(phase, []).append(time.perf_counter() - started)
                phases.enter("steps")

        setattr(cls, method, wrapper)


def worker(result_dir: str, argv: list[str]) -> int:
    """One trainer process under the measuring wrapper; writes `result_dir/rank-R.json`."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from hf_p2r.train import main as train_main
    from hf_p2r.training.engines import AccelerateEngine, PipelineEngine

    phases = Phases()
    for cls in (AccelerateEngine, PipelineEngine):
        for method, phase in (
            ("build", "build"),
            ("load", "load"),
            ("forward_backward", "steps"),
            ("optimizer_step", "optimizer step"),
            ("delink", "delink"),
            ("evaluate", "evaluate"),
            ("save_model", "save pseudo/, real/"),
            ("write_checkpoint", "save checkpoint"),
        ):
            phases.wrap(cls, method, phase)
    code = train_main(argv)
    phases.enter("end")
    rank = int(os.environ.get("RANK", "0"))
    launched = float(os.environ.get("BENCH_SCALE_LAUNCHED", "nan"))
    result = {
        "rank": rank,
        "exit_code": code,
        "peak_bytes": max(phases.peaks.values()),
        "phase_peak_bytes": phases.peaks,
        "phase_seconds": phases.seconds,
        "timeline": phases.timeline,
        "startup_s": (phases.first_step - launched) if phases.first_step else None,
    }
    Path(result_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    return code


# --- the driver -----------------------------------------------------------------------------------------------------
def trainer_argv(output_dir: Path, model: dict, fields: dict, **more) -> list[str]:
    argv = []
    for key, value in {**SCHEDULE, **model, **fields, **more, "output_dir": output_dir}.items():
        argv += [f"--{key}", str(value)]
    return argv


def launch(processes: int, argv: list[str], result_dir: Path, allocator: str = "fixed") -> list[dict]:
    """The trainer in `processes` processes under the wrapper, with `ALLOCATORS[allocator]`'s malloc settings; each
    rank's result, by rank."""
    result_dir.mkdir(parents=True, exist_ok=True)
    script = str(REPO / "scripts" / "bench_scale.py")
    if processes == 1:
        command = [sys.executable, script, "--worker", str(result_dir), "--", *argv]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [
            torchrun, "--nproc-per-node", str(processes), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), script, "--worker", str(result_dir), "--", *argv,
        ]  # fmt: skip
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "BENCH_SCALE_LAUNCHED": repr(time.time()),
        **ALLOCATORS[allocator],
    }
    if allocator == "glibc":
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads((result_dir / f"rank-{r}.json").read_text()) for r in range(processes)]


def parameters(model: dict) -> tuple[int, int]:
    """Parameters of the real model the trainer builds for `model` and of its largest block (the inventory's counts,
    nothing allocated)."""
    from hf_p2r.planning import block_parameters, parameter_tensors, real_parameters
    from hf_p2r.training import parse_config
    from hf_p2r.training.data import load_tokenizer

    config = parse_config(trainer_argv(Path("unused"), model, {}))
    vocab = config.model.vocab_size or -(-len(load_tokenizer(config.data.tokenizer_name)) // 64) * 64  # the trainer's
    real = config.p2r_config(vocab, config.model.num_hidden_layers, {})
    return real_parameters(real), block_parameters(parameter_tensors(real))


def losses(output_dir: Path) -> dict[int, float]:
    from hf_p2r.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}


def summarise(
    name: str, layout: str, ranks: list[dict], processes: int, params: tuple, seconds: float, allocator: str = "fixed"
) -> dict:
    peaks = [r["peak_bytes"] for r in ranks]
    worst = max(range(len(ranks)), key=lambda r: peaks[r])
    phase_peaks = ranks[worst]["phase_peak_bytes"]
    saves = [s for r in ranks for s in r["phase_seconds"].get("save checkpoint", [])]
    loads = [s for r in ranks for s in r["phase_seconds"].get("load", [])]
    return {
        "model": name,
        "layout": layout,
        "allocator": allocator,
        "processes": processes,
        "parameters": params[0],
        "block_parameters": params[1],
        "peak_bytes_per_process": peaks,
        "peak_bytes_max": max(peaks),
        "peak_bytes_total": sum(peaks),
        "peak_phase": max(phase_peaks, key=phase_peaks.get),
        "phase_peak_bytes_of_the_highest_process": phase_peaks,
        "startup_s": max(r["startup_s"] for r in ranks),
        # A save ends when its slowest process has written (they meet at a barrier): the slowest per save, then mean.
        "save_s": max(saves) if saves else None,
        "load_s": max(loads) if loads else None,
        "wall_s": seconds,
    }


def run_layout(
    workdir: Path, name: str, layout: str, params: tuple, allocator: str = "fixed", keep: bool = False
) -> tuple[dict, Path]:
    """One run measured; its weights and checkpoints deleted after it unless `keep` (a 170M model's are 5 GB)."""
    spec = {**LAYOUTS, **RESUMED_ON}[layout]  # (--quick's sharded layout is one of RESUMED_ON's)
    output_dir = workdir / f"{name}--{layout}--{allocator}".replace(" ", "_").replace("/", "_")
    started = time.perf_counter()
    argv = trainer_argv(output_dir, MODELS[name], spec["fields"])
    ranks = launch(spec["processes"], argv, output_dir / "bench", allocator)
    row = summarise(name, layout, ranks, spec["processes"], params, time.perf_counter() - started, allocator)
    print(
        f"{name:>9} | {layout:<28} | {allocator} | peak/process {row['peak_bytes_max'] / MiB:8.0f} MiB "
        f"({row['peak_phase']}) | start-up {row['startup_s']:5.1f} s | save {row['save_s'] or 0:5.2f} s | "
        f"{row['wall_s']:.0f} s",
        flush=True,
    )
    if not keep:
        discard(output_dir)
    return row, output_dir


def discard(output_dir: Path) -> None:
    """The run's model folders and checkpoints (its metrics and measurements stay)."""
    for name in ("checkpoints", "pseudo", "real"):
        shutil.rmtree(output_dir / name, ignore_errors=True)


def copy_for_resume(source: Path, destination: Path) -> Path:
    """`source` without its model folders and with checkpoint-RESUME_FROM alone: what a resume from it reads."""
    keep = f"checkpoint-{RESUME_FROM}"

    def left_out(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n in ("pseudo", "real") or (n.startswith("checkpoint-") and n != keep)]

    shutil.copytree(source, destination, ignore=left_out)
    return destination


def check_bound(rows: list[dict]) -> None:
    """Each row's peak above its layout's tiny run against issue 25's bound, and the planner's per-process figure."""
    from hf_p2r.planning import host_memory_per_process

    tiny = {(row["layout"], row["allocator"]): row for row in rows if row["model"] == "tiny"}
    for row in rows:
        key = (row["layout"], row["allocator"])
        if row["model"] == "tiny" or key not in tiny:
            continue
        params, n = row["parameters"], row["processes"]
        above = row["peak_bytes_max"] - tiny[key]["peak_bytes_max"]
        bound = STATE_BYTES_PER_PARAMETER * params / n + TRANSIENT_BYTES_PER_PARAMETER * params
        fields = {**LAYOUTS, **RESUMED_ON}[row["layout"]]["fields"]
        predicted = host_memory_per_process(
            params,
            n,
            stages=fields.get("pipeline_parallel_size", 1),
            sharded=fields.get("data_parallel_shard") == "true",
            block_parameters=row["block_parameters"],
        ).total
        row.update(
            above_tiny_bytes=above,
            bound_bytes=bound,
            within_bound=above <= bound,
            planner_bytes=predicted,
            planner_margin=(above - predicted) / predicted,
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[3:])  # --worker DIR -- TRAINER ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny and w512-L4 on 1 and 2 processes, tiny resumed on 1"
    )
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), help="default: every layout")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: every model")
    parser.add_argument("--resume-model", choices=sorted(MODELS), default="170M")
    parser.add_argument("--resume-layout", choices=sorted(LAYOUTS), default="4 sharded (FSDP2)")
    parser.add_argument("--workdir", default=None, help="the runs' folders (default: a temporary folder)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "scale"), help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    layouts = args.layouts or (QUICK["layouts"] if args.quick else list(LAYOUTS))
    models = args.models or (QUICK["models"] if args.quick else list(MODELS))
    resume_model = "tiny" if args.quick else args.resume_model
    resume_layout = QUICK["layouts"][1] if args.quick else args.resume_layout
    resumed_on = {name: RESUMED_ON[name] for name in QUICK["resumed_on"]} if args.quick else RESUMED_ON
    command = "python scripts/bench_scale.py " + " ".join(argv)
    report = {"date": now(), "machine": {**harness.machine(), "load_average_start": os.getloadavg()}}
    report["command"] = command
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(args.workdir or temporary)
        rows, uninterrupted = [], None
        for name in models:
            params = parameters(MODELS[name])
            for layout in layouts:
                if name == "170M" and layout not in BIG_LAYOUTS:
                    continue
                source = name == resume_model and layout == resume_layout
                row, output_dir = run_layout(workdir, name, layout, params, keep=source)
                rows.append(row)
                if source:
                    uninterrupted = output_dir
        if not args.quick:
            for name, layout in CONTRAST:
                rows.append(run_layout(workdir, name, layout, parameters(MODELS[name]), "glibc")[0])
        check_bound(rows)
        reference = {r["model"]: r["save_s"] for r in rows if r["layout"] == "1 process" and r["allocator"] == "fixed"}
        for row in rows:
            if reference.get(row["model"]) and row["save_s"] and row["allocator"] == "fixed":
                row["save_vs_one_process"] = row["save_s"] / reference[row["model"]]
        resumes = []
        if uninterrupted is not None:
            want = losses(uninterrupted)
            for layout, spec in resumed_on.items():
                copy = copy_for_resume(uninterrupted, workdir / f"resume--{layout}".replace(" ", "_"))
                checkpoint = copy / "checkpoints" / f"checkpoint-{RESUME_FROM}"
                started = time.perf_counter()
                ranks = launch(
                    spec["processes"],
                    trainer_argv(copy, MODELS[resume_model], spec["fields"], resume_from_checkpoint=checkpoint),
                    copy / "bench-resume",
                )
                got = losses(copy)
                discard(copy)
                after = [step for step in want if step > RESUME_FROM]
                difference = max(abs(got[s] - want[s]) / abs(want[s]) for s in after)
                resume = summarise(resume_model, layout, ranks, spec["processes"], parameters(MODELS[resume_model]), 0)
                resume.update(
                    resumed_from=f"{resume_layout}, checkpoint-{RESUME_FROM}",
                    losses={s: got[s] for s in after},
                    uninterrupted_losses={s: want[s] for s in after},
                    max_relative_difference=difference,
                    within_tolerance=difference <= RESUME_RTOL,
                    wall_s=time.perf_counter() - started,
                )
                print(
                    f"resumed on {layout}: load {resume['load_s']:.2f} s, max relative loss difference {difference:.1e}"
                )
                resumes.append(resume)
    report.update(rows=rows, resumes=resumes, resume_rtol=RESUME_RTOL, load_average_end=os.getloadavg())
    out = Path(args.out)
    write_json(out.with_suffix(".json"), report)
    write_text(out.with_suffix(".md"), render(report))
    print(f"wrote {out}.json and {out}.md")
    return 0


def _seconds(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _mib(value) -> str:
    return "" if value is None else f"{value / MiB:,.0f}"


def render(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Scale: host memory and start-up per process, DCP checkpoints, resume on another layout",
        "",
        f"{report['date']}, {m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, Python {m['python']}; load "
        f"average {m['load_average_start'][0]:.1f} at the start, {report['load_average_end'][0]:.1f} at the end "
        "(other work shared the cores: times are indicative, memory is not affected). Command: "
        f"`{report['command']}`.{' ' + report['note'] if report.get('note') else ''}",
        "",
        "Each row is the trainer (`torchrun`, gloo, one thread per process) through pseudo stage (1 block) -> delink "
        "-> real stage -> DCP checkpoints (steps 3 and 5) -> `real/`, 5 steps of 32-token sequences (global batch 4; "
        "8 for the 8-process layout). *peak* is the highest process's VmHWM; *above tiny* subtracts the same layout's "
        "run of the tiny model (Python, torch, gloo, the corpus); *bound* is issue 25's 16 B x P / N + 2 B x P "
        "(P: the real model's parameters); *planner* is `hf-p2r plan`'s per-process host figure for the same P and N "
        "and *margin* (measured - planner) / planner; *phase* is where the highest process peaked. Start-up: launch "
        "to the first training step (slowest process). Save: the slowest process's DCP save of the real model, "
        "weights and AdamW state. *malloc*: `fixed` runs with `MALLOC_MMAP_THRESHOLD_=131072` (every allocation of "
        "128 KiB or more its own mapping, returned to the system when freed), `glibc` with glibc's default, whose "
        "threshold rises to the largest block freed so far (up to 32 MiB): FSDP2's gathered blocks and the optimizer's "
        "temporaries then come from the heap, and the pages they free stay resident.",
        "",
        "| model | P | layout | N | malloc | peak/process MiB | above tiny | bound | within | planner | margin | "
        "phase | total MiB | start-up s | save s | save / 1 process |",
        "|---|---:|---|---:|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        within = "" if "within_bound" not in r else ("yes" if r["within_bound"] else "**no**")
        margin = "" if "planner_margin" not in r else f"{r['planner_margin']:+.0%}"
        ratio = f"{r['save_vs_one_process']:.2f}x" if r.get("save_vs_one_process") else ""
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['layout']} | {r['processes']} | {r['allocator']} | "
            f"{_mib(r['peak_bytes_max'])} | {_mib(r.get('above_tiny_bytes'))} | {_mib(r.get('bound_bytes'))} | "
            f"{within} | {_mib(r.get('planner_bytes'))} | {margin} | {r['peak_phase']} | "
            f"{_mib(r['peak_bytes_total'])} | {r['startup_s']:.1f} | "
            f"{_seconds(r['save_s'])} | {ratio} |"
        )
    lines += _depth_lines(report["rows"]) + _phase_lines(report["rows"]) + WHY
    if report["resumes"]:
        first = report["resumes"][0]
        lines += [
            "",
            f"## Resumed on another layout ({first['model']}, from the {first['resumed_from']})",
            "",
            f"The losses after the checkpoint against the uninterrupted run's; tolerance {report['resume_rtol']:.0e} "
            "relative (DCP reshards the same fp32 values; the sums of the gradients' reductions run in another "
            "order).",
            "",
            "| resumed on | N | load s | peak/process MiB | max relative loss difference | within |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in report["resumes"]:
            lines.append(
                f"| {r['layout']} | {r['processes']} | {r['load_s']:.2f} | {_mib(r['peak_bytes_max'])} | "
                f"{r['max_relative_difference']:.1e} | {'yes' if r['within_tolerance'] else '**no**'} |"
            )
    return "\n".join(lines) + "\n"


def _depth_lines(rows: list[dict]) -> list[str]:
    """Per sharded layout: the peak above tiny minus the state share, per depth (flat: no process holds the model)."""
    depth_rows = [
        r for r in rows if r["model"].startswith("w512") and "above_tiny_bytes" in r and r["allocator"] == "fixed"
    ]
    if not depth_rows:
        return []
    lines = [
        "",
        "## Against the number of layers (width 512)",
        "",
        "Peak above tiny minus the process's share of the training state (16 B x P / N): what a process holds beyond "
        "its share. Where no process holds a whole stage (FSDP2 over the whole model, or a pipeline's sharded stages, "
        "each micro-batch's backward resharded and reduce-scattered) it grows with the share (AdamW's fp32 temporary, "
        "4 B x P / N, and a gathered block or two), not with the model; replicated stages hold their whole stage's "
        "state.",
        "",
        "| layout | " + " | ".join(sorted({r["model"] for r in depth_rows}, key=_depth)) + " |",
        "|---|" + "---:|" * len({r["model"] for r in depth_rows}),
    ]
    for layout in dict.fromkeys(r["layout"] for r in depth_rows):
        cells = []
        for r in sorted((r for r in depth_rows if r["layout"] == layout), key=lambda r: _depth(r["model"])):
            share = STATE_BYTES_PER_PARAMETER * r["parameters"] / r["processes"]
            cells.append(f"{_mib(r['above_tiny_bytes'] - share)} MiB (P {r['parameters'] / 1e6:.0f}M)")
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return lines


def _phase_lines(rows: list[dict]) -> list[str]:
    """The highest process's peak per phase, for the largest model's rows and the allocator contrast."""
    largest = max((r["parameters"] for r in rows), default=0)
    shown = [r for r in rows if r["model"] != "tiny" and (r["parameters"] == largest or r["allocator"] != "fixed")]
    shown += [r for r in rows if r["allocator"] != "fixed" and r["model"] != "tiny" and r not in shown]
    if not shown:
        return []
    phases = list(dict.fromkeys(p for r in shown for p in r["phase_peak_bytes_of_the_highest_process"]))
    lines = [
        "",
        "## Where the highest process peaks",
        "",
        "Peak resident MiB of the highest process within each phase of the run (VmHWM reset at each phase's start; "
        "*steps* is everything between the engine calls timed: forward and backward, the loss, logging).",
        "",
        "| model | layout | malloc | " + " | ".join(phases) + " |",
        "|---|---|---|" + "---:|" * len(phases),
    ]
    for r in shown:
        peaks = r["phase_peak_bytes_of_the_highest_process"]
        cells = " | ".join(_mib(peaks.get(p)) for p in phases)
        lines.append(f"| {r['model']} | {r['layout']} | {r['allocator']} | {cells} |")
    return lines


# Why a process holds more than its share (the planner's terms, hf_p2r.planning.host_memory_per_process).
WHY = [
    "",
    "## Why a row is over the bound",
    "",
    "- FSDP2, over the whole model (`pipeline_parallel_size: 1`) or in each stage of a pipeline (`data_parallel_shard: "
    "true`; `ShardedPipelineStage` reshards and reduce-scatters after each micro-batch's backward, where torch's "
    "`PipelineStage` would keep the stage gathered and its gradients whole for the step, 8 bytes per parameter of "
    "the stage: the 170M model's 8-process pipeline then held 915 MiB above tiny against a bound of 627), gathers "
    "a block or two at a time: beyond its share a process holds the running block's weights and gradient and the "
    "next block's weights (the planner's *gathered* term: 12 bytes per parameter of the largest block), its root "
    "unit's (embeddings or head), a pipeline stage the activations of its micro-batches in flight, and AdamW's "
    "temporary of its share. Under 2 bytes per parameter of the model when a block is a small part of it; with 4 "
    "layers one block is a quarter of the model.",
    "- Replicated stages hold their whole stage's training state (16 bytes per parameter of the stage): a contrast, "
    "not a sharded layout.",
    "- With glibc's default allocator (`malloc` glibc) the pages freed by FSDP2's gathers stay resident.",
]


def _depth(model: str) -> int:
    return int(model.rsplit("L", 1)[1]) if "-L" in model else math.inf
