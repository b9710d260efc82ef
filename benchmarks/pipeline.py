"""Pipeline parallelism measured: step time and memory per schedule on 2 processes, per-stage forward/backward times
(for the schedule simulator), and PipeDream-2BW's convergence against a flush schedule on the demo config, under
AdamW and Muon, with and without 2BW's error-feedback delay correction (`--optimizers`; each seed runs every variant).

    python scripts/bench_pipeline.py                  # timing on 2 CPU processes (gloo): benchmarks/pipeline.{json,md}
    python scripts/bench_pipeline.py --convergence    # then 1f1b vs 2bw (+ef) per optimizer on configs/demo.yaml
    python scripts/bench_pipeline.py --convergence --keep-timing   # convergence only, timing kept from OUT.json
    python scripts/bench_pipeline.py --preset tiny --rounds 1 --steps 1 --out /tmp/p   # smoke run

Timing: every schedule's pipeline is built in the same two processes and they are timed round by round (gpipe, 1f1b,
interleaved_1f1b, zero_bubble, 2bw, gpipe, ...), so each median compares runs taken seconds apart. A step is one
batch's micro-batches, forward and backward, and the optimizer step (2BW steps its optimizer inside; its round ends
with a drain, counted: one pipeline fill and drain per round of --steps steps). Memory per
stage: the peak bytes of tensors autograd saved for backward (a `saved_tensors_hooks` count: the activations the
schedule keeps in flight), the bytes of weight versions (2BW keeps two) and of optimizer state; CPU processes have
no per-schedule allocator statistics, so these are counted, not read from the OS (`ru_maxrss` of each process is
given for the whole run). Per-stage times: the mean wall time of `forward_one_chunk` and `backward_one_chunk` per
micro-batch in the 1f1b runs (communication waits excluded: they happen before), `stage_times()` returns them.
"""

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import harness, presets
from benchmarks.harness import REPO, free_port, nbytes, optimizer_state_bytes, write_json, write_text

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "2bw")
PRESETS = {
    "tiny": dict(presets.TINY, batch=4, seq=16, microbatches=2),
    # The demo model's shape (configs/demo.yaml) with its batch: 8 blocks of 128 tokens, 4 micro-batches.
    "cpu": dict(
        presets.model(hidden=128, ffn=384, heads=4, kv_heads=4, layers=8, vocab=384), batch=8, seq=128, microbatches=4
    ),
}


def machine() -> dict:
    """The harness's machine description, with the load average at the start."""
    return {**harness.machine(), "load_average": os.getloadavg()}


def now() -> str:
    """The time now, UTC, to the minute, as this page states it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward (pack hook adds, the tensor's death subtracts)."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if not isinstance(tensor, torch.nn.Parameter):  # weights are counted as versions
            # A detached alias (same storage, no grad_fn), one per save. Returning `tensor` itself would make a saved
            # output hold its own grad_fn: a cycle through C++ that gc cannot collect, so a graph never backwarded
            # with retain_graph=False (zero bubble's input-gradient half runs with retain_graph=True) would stay
            # alive; and a tensor saved at every step (torch's reused receive buffers) would be counted once per step
            # and subtracted once (torch's saved_tensors_hooks docs, pytorch/pytorch#115255).
            tensor = tensor.detach()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(tensor):
        return tensor


def _timed(stage, kind: str, record: dict):
    """Wrap `stage.forward_one_chunk` / `backward_one_chunk` to add each call's wall time to record[kind]."""
    method = getattr(stage, f"{kind}_one_chunk")

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record[kind].append(time.perf_counter() - started)

    setattr(stage, f"{kind}_one_chunk", wrapper)


def _worker(rank: int, world: int, port: int, preset: dict, rounds: int, steps: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hf_p2r import P2RConfig, P2RForCausalLM
    from hf_p2r.distributed.pipeline import build_pipeline

    dims = {k: v for k, v in preset.items() if k not in ("batch", "seq", "microbatches")}
    batch = torch.randint(
        0, preset["vocab_size"], (preset["batch"], preset["seq"]), generator=torch.Generator().manual_seed(0)
    )
    runs = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = P2RForCausalLM(P2RConfig(**dims)).train()
        pipeline = build_pipeline(
            model,
            schedule=schedule,
            num_microbatches=preset["microbatches"],
            seq_len=preset["seq"],
            optimizer_factory=_adamw,
        )
        optimizer = pipeline.schedule.optimizer if schedule == "2bw" else _adamw(pipeline.parameters())
        times = {"forward": [], "backward": []}
        for stage in pipeline.stages:
            _timed(stage, "forward", times)
            _timed(stage, "backward", times)
        runs[schedule] = dict(
            pipeline=pipeline, optimizer=optimizer, saved=SavedBytes(), step_s=[], times=times, live_after_round=[]
        )
    for index in range(warmup + rounds):
        for schedule, run in runs.items():
            dist.barrier()
            with torch.autograd.graph.saved_tensors_hooks(run["saved"].pack, run["saved"].unpack):
                started = time.perf_counter()
                for _ in range(steps):
                    run["pipeline"].step(batch)
                    if schedule != "2bw":
                        run["optimizer"].step()
                        run["optimizer"].zero_grad(set_to_none=True)
                # 2BW's last micro-batches are still in flight: finish them before another schedule uses the
                # processes' channels (their messages would be taken for the next schedule's). One fill and drain
                # per round, as a flush schedule has one per step.
                run["pipeline"].drain()
                dist.barrier()
                elapsed = (time.perf_counter() - started) / steps
            gc.collect()
            run["live_after_round"].append(run["saved"].live)  # a schedule that frees everything: constant
            if index >= warmup:
                run["step_s"].append(elapsed)
            else:
                run["times"]["forward"].clear()
                run["times"]["backward"].clear()
    result = {}
    for schedule, run in runs.items():
        pipeline = run["pipeline"]
        versions = 2 if schedule == "2bw" else 1
        weights = nbytes(pipeline.parameters()) * versions
        optimizer = run["pipeline"].schedule.optimizer if schedule == "2bw" else run["optimizer"]
        state = optimizer_state_bytes(optimizer)
        result[schedule] = {
            "step_s": run["step_s"],
            "saved_activation_peak_bytes": run["saved"].peak,
            "saved_alive_after_each_round_bytes": run["live_after_round"],
            "weight_bytes": weights,
            "optimizer_state_bytes": state,
            "forward_s": statistics.mean(run["times"]["forward"]) if run["times"]["forward"] else None,
            "backward_s": statistics.mean(run["times"]["backward"]) if run["times"]["backward"] else None,
            "stages": [stage.stage_index for stage in pipeline.stages],
        }
    result["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    gc.collect()  # cycles holding gloo's objects go now, not at exit (where gloo aborts)
    dist.destroy_process_group()


def _adamw(params):
    return torch.optim.AdamW(list(params), lr=1e-3)


def measure(preset: dict, rounds: int, steps: int, warmup: int, world: int = 2) -> dict:
    """Run the timing part; returns {schedule: {...}} with per-rank lists and medians."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ranks.json"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        mp.spawn(_worker, args=(world, port, preset, rounds, steps, warmup, str(out)), nprocs=world, join=True)
        ranks = json.loads(out.read_text())
    summary = {}
    for schedule in SCHEDULES:
        per_rank = [rank[schedule] for rank in ranks]
        # A step ends on every rank at the barrier: the slowest rank's time is the step time.
        step = [max(values) for values in zip(*(r["step_s"] for r in per_rank), strict=True)]
        summary[schedule] = {
            "step_s_median": statistics.median(step),
            "step_s_min": min(step),
            "step_s_max": max(step),
            "per_stage": per_rank,
        }
    summary["ru_maxrss_mib"] = [rank["ru_maxrss_mib"] for rank in ranks]
    return summary


def stage_times(results: dict, schedule: str = "1f1b") -> list[dict]:
    """[{stage, forward_s, backward_s}] per process from a `measure` (or benchmarks/pipeline.json "timing") result:
    the measured mean per-micro-batch times the schedule simulator takes as input."""
    return [
        {"stages": rank["stages"], "forward_s": rank["forward_s"], "backward_s": rank["backward_s"]}
        for rank in results[schedule]["per_stage"]
    ]


# (schedule, optimizer, delay correction) of each convergence run: 2BW against 1F1B with the same optimizer.
VARIANTS = tuple(
    (schedule, optimizer, correction)
    for optimizer in ("adamw", "muon")
    for schedule, correction in (("1f1b", "none"), ("2bw", "none"), ("2bw", "error_feedback"))
)
# Issue 27's target for 2BW under Muon (with or without the correction): its mean final validation loss at most this
# far above 1F1B's with the same optimizer, and within 1F1B's seed-to-seed spread.
TARGET_NATS = 0.05


def variant_name(schedule: str, optimizer: str, correction: str) -> str:
    return f"{schedule}{'+ef' if correction != 'none' else ''}/{optimizer}"


def convergence(seeds: list[int], steps: int | None, out: Path, optimizers=("adamw", "muon")) -> dict:
    """configs/demo.yaml under 1f1b and 2bw (2 processes, same data and steps) per seed and optimizer (AdamW, Muon),
    2bw also with the error-feedback delay correction; final validation losses, 2BW minus 1F1B with the same
    optimizer, seed by seed."""
    runs, started, load_before = {}, time.perf_counter(), os.getloadavg()
    variants = [v for v in VARIANTS if v[1] in optimizers]
    for seed in seeds:
        for schedule, optimizer, correction in variants:
            name = f"{variant_name(schedule, optimizer, correction)}/{seed}"
            with tempfile.TemporaryDirectory() as folder:
                argv = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    "--master-port",  # a free port: another torchrun on the machine would take the default one
                    str(free_port()),
                    str(REPO / "scripts/train.py"),
                    "--config",
                    str(REPO / "configs/demo.yaml"),
                    "--output_dir",
                    folder,
                    "--seed",
                    str(seed),
                    "--pipeline_parallel_size",
                    "2",
                    "--pipeline_schedule",
                    schedule,
                    "--num_microbatches",
                    "4",
                    "--optimizer",
                    optimizer,
                    "--pipeline_delay_correction",
                    correction,
                    "--save_steps",
                    "0",
                    "--eval_steps",
                    "40",
                    "--save_total_limit",
                    "1",
                ]
                if steps:
                    # The demo's proportion: the last delink at a third of the run (80 of 240).
                    argv += ["--pseudo_steps", str(steps // 3), "--real_steps", str(steps - steps // 3)]
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
                subprocess.run(argv, check=True, env=env, cwd=REPO, capture_output=True)
                records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
            runs[name] = {
                "loss": [(r["step"], r["loss"]) for r in records if "loss" in r],
                "val_loss": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
            }
            print(f"convergence: {name}: final val_loss {runs[name]['val_loss'][-1]}", flush=True)
    final = {key: run["val_loss"][-1][1] for key, run in runs.items()}
    comparisons = {}
    for schedule, optimizer, correction in variants:
        if schedule == "1f1b":
            continue
        name = variant_name(schedule, optimizer, correction)
        flush = [final[f"1f1b/{optimizer}/{seed}"] for seed in seeds]
        differences = [final[f"{name}/{seed}"] - final[f"1f1b/{optimizer}/{seed}"] for seed in seeds]
        mean = statistics.mean(differences)
        spread = (max(flush) - min(flush)) if len(flush) > 1 else None
        comparisons[name] = {
            "difference_minus_1f1b": differences,
            "mean_difference": mean,
            "flush_seed_spread": spread,
            "target_met": None
            if optimizer != "muon" or spread is None
            else bool(mean <= TARGET_NATS and abs(mean) <= spread),
        }
    return {
        "seeds": seeds,
        "steps": steps or "the demo's",
        "variants": [variant_name(*v) for v in variants],
        "runs": runs,
        "final_val_loss": final,
        "comparisons": comparisons,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_time_s": time.perf_counter() - started,
    }


def rule_check(steps: int, lr_factors: tuple[float, ...] = (1.0, 0.25)) -> dict:
    """One process, no pipeline: plain AdamW vs the 2BW update rule W(t+1) = W(t) - AdamW(grad f_t(W(t-1))) on the
    demo's pseudo model, data, micro-batches, learning-rate schedule and clipping, `steps` steps; final validation loss
    of each, at the demo's peak learning rate times each of `lr_factors`. Separates what the rule does at this scale
    from what the pipeline does, and shows how the stale gradient's cost depends on the step size."""
    import copy

    from hf_p2r.training import parse_config
    from hf_p2r.training.data import BlockOrder, build_blocks, load_tokenizer
    from hf_p2r.training.optim import build_optimizer, learning_rate_at
    from hf_p2r.training.train import build_model

    torch.set_num_threads(1)
    config = parse_config(
        [
            "--config",
            str(REPO / "configs/demo.yaml"),
            "--shared_lr_scale",
            "none",
            "--pseudo_steps",
            str(steps),
            "--real_steps",
            "0",
        ]
    )
    args = config.train
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    train, validation = build_blocks(config.data, tokenizer, args.seed)
    order = BlockOrder(len(train), args.seed)
    batch = args.per_device_batch_size
    chosen = [index * len(validation) // args.eval_blocks for index in range(min(len(validation), args.eval_blocks))]

    def run(delayed: bool, factor: float) -> float:
        torch.manual_seed(args.seed)
        model = build_model(config, tokenizer, config.initial_blocks())
        optimizer = build_optimizer(model, args)
        previous = copy.deepcopy(model)
        for step in range(steps):
            ids = train[order.indices(step * batch, batch)]["input_ids"]
            for group in optimizer.param_groups:
                group["lr"] = factor * learning_rate_at(step, args, [])
            net = previous if delayed else model
            net.zero_grad()
            for chunk in ids.chunk(4):
                (net(input_ids=chunk, labels=chunk).loss / 4).backward()
            if delayed:
                snapshot = copy.deepcopy(model.state_dict())
                for param, used in zip(model.parameters(), previous.parameters(), strict=True):
                    param.grad = used.grad
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if delayed:
                previous.load_state_dict(snapshot)
        with torch.no_grad():
            ids = validation[chosen]["input_ids"]
            return statistics.mean(model(input_ids=c, labels=c).loss.item() for c in ids.split(batch))

    by_lr = [
        {
            "learning_rate": factor * args.learning_rate,
            "flush_val_loss": run(False, factor),
            "rule_2bw_val_loss": run(True, factor),
        }
        for factor in lr_factors
    ]
    return {"steps": steps, "by_lr": by_lr}


def render(report: dict) -> str:
    m, t = report["machine"], report["timing"]
    lines = [
        "# Pipeline parallelism: measured step time and memory per schedule (2 processes)",
        "",
        f"Produced by `scripts/bench_pipeline.py` on {report['date']}: {m['cpu']}, {m['cpu_count']} cores, "
        f"load average {', '.join(f'{x:.1f}' for x in m['load_average'])} at the start (other work shared the "
        f"machine), torch {m['torch']}, {m['platform']}. Model: {report['preset']} "
        f"({report['preset_fields']}); {report['rounds']} interleaved rounds of {report['steps']} step(s) after "
        f"{report['warmup']} warm-up round(s), gloo, one thread per process.",
        "",
        "| schedule | step time median (s) | min | max | saved activations peak, stage 0 / 1 (MiB) | saved tensors "
        "still alive after the first / last round, stage 0; stage 1 (MiB) | weights (MiB, all versions) stage 0 / 1 "
        "| optimizer state (MiB) stage 0 / 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for schedule in SCHEDULES:
        row, ranks = t[schedule], t[schedule]["per_stage"]

        def pair(key, ranks=ranks):
            return " / ".join(f"{rank[key] / mib:.2f}" for rank in ranks)

        alive = "; ".join(
            f"{rank['saved_alive_after_each_round_bytes'][0] / mib:.2f} / "
            f"{rank['saved_alive_after_each_round_bytes'][-1] / mib:.2f}"
            for rank in ranks
        )
        lines.append(
            f"| {schedule} | {row['step_s_median']:.3f} | {row['step_s_min']:.3f} | {row['step_s_max']:.3f} | "
            f"{pair('saved_activation_peak_bytes')} | {alive} | {pair('weight_bytes')} | "
            f"{pair('optimizer_state_bytes')} |"
        )
    lines += [
        "",
        "Interleaved schedules run two stages per process (stages 0, 2 and 1, 3). 2BW's step includes the previous "
        "batch's optimizer step and keeps two weight versions; the flush schedules step after the flush. Saved tensors "
        "still alive after a round (after `gc.collect()`): 0 where every step frees what it saved; a value that "
        "grew from round to round would be saved-tensor memory kept past its step, and the peak column would include "
        "it. (An earlier version of this page showed zero_bubble's growing, 58 -> 320 MiB: the count's own pack hook "
        "kept each tensor it saw alive through a reference cycle; it now packs a detached alias.)",
        "",
        "Per-stage mean times per micro-batch under 1f1b (what `stage_times()` returns, the simulator's input):",
        "",
        "| process | stages | forward (ms) | backward (ms) |",
        "|---|---|---|---|",
    ]
    for rank, row in enumerate(stage_times(t)):
        lines.append(f"| {rank} | {row['stages']} | {1000 * row['forward_s']:.2f} | {1000 * row['backward_s']:.2f} |")
    lines += ["", f"Peak resident memory per process (whole run, all schedules): {t['ru_maxrss_mib']} MiB.", ""]
    c = report.get("convergence")
    if c is None:
        lines.append("Convergence (2BW vs a flush schedule on the demo config): not run for this report.")
    else:
        lines += convergence_section(report, c)
    if report.get("convergence_long") is not None:
        lines += ["", *convergence_section(report, report["convergence_long"], "convergence_long")]
    r = report.get("rule_check")
    if r is not None:
        lines += [
            "",
            f"The update rule alone (one process, no pipeline, seed 0, the demo's one-block pseudo model, {r['steps']} "
            "steps, same data, micro-batches, schedule shape and clipping), final validation loss with plain AdamW and "
            "with W(t+1) = W(t) − AdamW(∇f(W(t−1))), per peak learning rate:",
            "",
            "| peak learning rate | AdamW | 2BW rule | difference |",
            "|---|---|---|---|",
        ]
        for row in r.get("by_lr") or [{"learning_rate": None, **r}]:
            rate = "demo's" if row["learning_rate"] is None else f"{row['learning_rate']:g}"
            lines.append(
                f"| {rate} | {row['flush_val_loss']:.4f} | {row['rule_2bw_val_loss']:.4f} | "
                f"{row['rule_2bw_val_loss'] - row['flush_val_loss']:+.4f} |"
            )
    return "\n".join(lines) + "\n"


def convergence_section(report: dict, c: dict, key: str = "convergence") -> list[str]:
    """The page's section on 2BW against 1F1B per optimizer (from `convergence`'s result, stored under `key`)."""
    variants, seeds, final = c["variants"], c["seeds"], c["final_val_loss"]
    before, after = c["load_average_before"], c["load_average_after"]
    title = "" if key == "convergence" else f", longer: {c['steps']} steps"
    steps, schedule = "same steps", "the demo's own schedule"
    if key != "convergence":
        steps, schedule = f"{c['steps']} steps", "the demo's schedule stretched, the last delink at a third"
    command = c.get("command", "python scripts/bench_pipeline.py --convergence --keep-timing")
    lines = [
        f"## PipeDream-2BW vs 1F1B (flush) on configs/demo.yaml, AdamW and Muon, with and without the delay "
        f"correction{title}",
        "",
        f"Run on {report.get(key + '_date')} ({c['wall_time_s'] / 60:.0f} min for {len(c['runs'])} runs, one at "
        f"a time, `nice -n 10`; load average {', '.join(f'{x:.1f}' for x in before)} before and "
        f"{', '.join(f'{x:.1f}' for x in after)} after: other work shared the machine). Same data, {steps} "
        f"({schedule}: pseudo model grown 1 -> 2 -> 4 blocks, delinked to 8, `shared_lr_scale: depth`), 2 "
        "processes, 4 micro-batches; `optimizer: muon` is Muon for the blocks' matrices and AdamW for the rest, "
        "Muon's rate the demo's learning rate (`muon_adjust_lr_fn: match_rms_adamw`, untuned); `+ef` is "
        f"`pipeline_delay_correction: error_feedback`. Command: `nice -n 10 {command}`. Final validation loss per "
        "seed:",
        "",
        "| seed | " + " | ".join(variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for seed in seeds:
        lines.append(f"| {seed} | " + " | ".join(f"{final[f'{v}/{seed}']:.4f}" for v in variants) + " |")
    lines += [
        "",
        f"2BW minus 1F1B with the same optimizer (per seed; mean; the 1F1B runs' seed-to-seed spread, max - min of "
        f"their final losses). Issue 27's target for Muon: mean <= {TARGET_NATS} nats and within that spread:",
        "",
        "| variant | per seed | mean | 1F1B spread | target |",
        "|---|---|---|---|---|",
    ]
    for name, row in c["comparisons"].items():
        spread = "n/a" if row["flush_seed_spread"] is None else f"{row['flush_seed_spread']:.4f}"
        target = {None: "(AdamW: none)" if "adamw" in name else "n/a", True: "met", False: "missed"}[row["target_met"]]
        per_seed = ", ".join(f"{d:+.4f}" for d in row["difference_minus_1f1b"])
        lines.append(f"| {name} | {per_seed} | {row['mean_difference']:+.4f} | {spread} | {target} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--convergence", action="store_true", help="also run 1f1b vs 2bw (+ef) per optimizer on configs/demo.yaml"
    )
    parser.add_argument("--optimizers", nargs="+", choices=["adamw", "muon"], default=["adamw", "muon"])
    parser.add_argument(
        "--convergence-key",
        choices=["convergence", "convergence_long"],
        default="convergence",
        help="where the convergence result goes (convergence_long: a longer setting, its own section)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--convergence-steps", type=int, default=None, help="default: the demo's 240")
    parser.add_argument("--keep-timing", action="store_true", help="reuse OUT.json's timing (and its date, machine)")
    parser.add_argument("--keep-convergence", action="store_true", help="reuse OUT.json's convergence results")
    parser.add_argument("--rule-check", type=int, default=0, help="steps of the one-process 2BW-rule check (0: none)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "pipeline"), help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    report = {
        "date": now(),
        "machine": machine(),
        "preset": args.preset,
        "preset_fields": ", ".join(f"{k}={v}" for k, v in PRESETS[args.preset].items()),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if args.keep_convergence:
        kept = json.loads(Path(args.out + ".json").read_text())
        report.update({key: kept[key] for key in ("convergence", "convergence_date") if key in kept})
    if args.keep_timing:
        kept = json.loads(Path(args.out + ".json").read_text())
        report.update({key: value for key, value in kept.items() if key != "convergence"})
    else:
        report["timing"] = measure(PRESETS[args.preset], args.rounds, args.steps, args.warmup)
    if args.keep_convergence and "rule_check" in kept:
        report["rule_check"] = kept["rule_check"]
    if args.rule_check:
        report["rule_check"] = rule_check(args.rule_check)
    if args.convergence:
        key = args.convergence_key
        report[f"{key}_date"] = now()
        report[key] = convergence(args.seeds, args.convergence_steps, Path(args.out), args.optimizers)
        report[key]["command"] = "python scripts/bench_pipeline.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    write_json(out.with_name(out.name + ".json"), report, indent=1)
    write_text(out.with_name(out.name + ".md"), render(report))
    print(f"wrote {out}.json and {out}.md")
    return 0
