"""The pipeline schedule simulator (hf_p2r/distributed/simulate.py): checked against measured CPU runs, then used at
scale to reproduce PipeDream-2BW's comparison (arXiv 2006.09503) of 2BW, GPipe and 1F1B-flush.

1. Measured: hf-p2r's pipeline runtime (`hf_p2r.distributed.pipeline`: torch's `ScheduleGPipe` / `Schedule1F1B`
   and hf-p2r's PipeDream-2BW) on 2 and 4 CPU processes (gloo, started with torchrun), one stage per process over
   the depths of a real P2R model (embeddings on the first stage, final norm, head and loss on the last). In
   interleaved rounds each process times its own stage's forward and backward on one micro-batch (all processes at
   once, then one at a time), ranks 0 and 1 time a send/recv of one micro-batch's activations, one step of each
   flush schedule is timed, then a burst of 2BW steps back to back. The simulator predicts each step time from the
   profiles and the send alone.
2. At scale: a GPT-style model at d = 8, 16, 32 stages on the planner's hardware (`hf_p2r.planning` `Hardware`
   defaults: H100 peak FLOP/s x MFU, NVLink inside a node, InfiniBand across); per-stage times from the planner's
   FLOP count, memory and fit from the planner's `estimate` for each schedule, with activation recomputation where
   a schedule does not fit without it (as the paper's planner decides).

    python scripts/bench_pipeline_sim.py                  # writes benchmarks/pipeline_sim.{json,md}
    python scripts/bench_pipeline_sim.py --preset tiny --rounds 1 --out /tmp/p   # smoke run
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import presets
from benchmarks.harness import REPO, machine, utc_now, write_json, write_text

PRESETS = {
    "tiny": dict(presets.TINY, micro_batch=1, seq=16),
    # Tens of milliseconds per stage and micro-batch on one core: compute-bound, not dominated by Python.
    "cpu": dict(presets.CPU, vocab_size=4096, micro_batch=2, seq=128),
}
# What torchrun starts on each process: this benchmark's script, whose --worker runs `worker`.
SCRIPT = REPO / "scripts" / "bench_pipeline_sim.py"

# The model of the comparison at scale: GPT-3 2.7B's shape (Brown et al. 2020: 32 layers, d_model 2560, 32 heads,
# 2048 tokens) and a 64-layer, 4096-wide one (~13B) where memory starts to matter; Llama-style blocks (SwiGLU with
# 8h/3 rounded up to 256, as GPT's 4h GELU MLP has 8h^2 parameters), vocabulary 51200 (GPT-2's, padded).
GPT_MODELS = {
    "gpt-2.7B": dict(hidden_size=2560, intermediate_size=6912, num_attention_heads=32, num_hidden_layers=32),
    "gpt-13B": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=64),
}
SCALE_DEPTHS = (8, 16, 32)
SWEEP_DEPTHS = (4, 8, 16, 32, 64)


# ---------------------------------------------------------------------------------------------------------------
# 1. Measured CPU runs (one process per stage, under torchrun)
# ---------------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from hf_p2r import P2RConfig, P2RForCausalLM
    from hf_p2r.distributed.pipeline import build_pipeline, causal_lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    preset = dict(PRESETS[args.preset])
    micro_batch, seq = preset.pop("micro_batch"), preset.pop("seq")
    torch.manual_seed(0)
    model = P2RForCausalLM(P2RConfig(**preset, max_position_embeddings=seq, tie_word_embeddings=False))
    model.set_attn_implementation("sdpa")
    microbatches, layers = args.microbatches, preset["num_hidden_layers"]
    ids = torch.randint(0, preset["vocab_size"], (microbatches * micro_batch, seq))
    hidden = torch.randn(micro_batch, seq, preset["hidden_size"])

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4)

    # hf-p2r's pipeline runtime (hf_p2r.distributed.pipeline): equal layers per stage, each schedule on its own copy
    # of the model (2BW swaps weight versions in and out of its modules).
    pipelines = {
        name: build_pipeline(
            copy.deepcopy(model), schedule=name, num_microbatches=microbatches, split=[layers // world] * world,
            seq_len=seq, optimizer_factory=adamw if name == "2bw" else None,
        )
        for name in ("gpipe", "1f1b", "2bw")
    }  # fmt: skip
    module = pipelines["gpipe"].modules[0]
    loss_fn = causal_lm_loss(preset["vocab_size"])

    def step(pipeline) -> float:
        dist.barrier()
        start = time.perf_counter()
        pipeline.step(ids)
        dist.barrier()
        for param in pipeline.parameters():
            param.grad = None
        return time.perf_counter() - start

    example = ids[:micro_batch] if rank == 0 else hidden
    last_loss = loss_fn if rank == world - 1 else None
    for name in ("gpipe", "1f1b"):
        step(pipelines[name])  # warmup
    rounds = []
    two_bw = pipelines["2bw"]
    # Interleaved rounds: each round profiles the stages, times the send, times one step of each flush schedule, then
    # a burst of 2BW steps, so a prediction and its measurements are seconds apart on a machine whose load drifts.
    # 2BW streams batches with no flush: a burst runs its steps back to back (no barrier, no other communication
    # between them, which would meet its sends still in flight), each process noting when each step returns; the
    # first step fills the pipeline, the intervals after it are the steady state; `drain()` ends the burst.
    for _ in range(args.rounds):
        together = profile_stage(module, example, last_loss, ids, args.repeats)
        alone = (0.0, 0.0)
        for turn in range(world):  # one stage at a time: its time without the other processes competing for cores
            dist.barrier()
            if turn == rank:
                alone = profile_stage(module, example, last_loss, ids, args.repeats, barrier=False)
            dist.barrier()
        p2p_s = ping_pong(hidden, args.repeats) if world > 1 else 0.0
        measured = {name: step(pipelines[name]) for name in ("gpipe", "1f1b")}
        dist.barrier()
        ends = []
        for _ in range(4):
            two_bw.step(ids)
            ends.append(time.perf_counter())
        two_bw.schedule.drain()
        measured["2bw"] = statistics.median(b - a for a, b in zip(ends, ends[1:]))
        gathered = [None] * world
        dist.all_gather_object(gathered, {"together": together, "alone": alone})
        rounds.append({"stages": gathered, "p2p_s": p2p_s, "measured_step_s": measured})

    # 2BW's optimizer step on each stage, alone.
    optimizer, updates = two_bw.schedule.optimizer, []
    for param in two_bw.parameters():
        param.grad = torch.zeros_like(param)
    for i in range(args.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        if i:
            updates.append(time.perf_counter() - start)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"update_s": statistics.median(updates)})
    if rank == 0:
        result = {
            "processes": world,
            "microbatches": microbatches,
            "threads_per_process": torch.get_num_threads(),
            "rounds": rounds,
            "two_bw_update_s": [rank_["update_s"] for rank_ in gathered],
        }
        Path(args.worker_out).write_text(json.dumps(result))
    gc.collect()  # cycles holding gloo's objects go now, not at exit (where gloo aborts)
    dist.destroy_process_group()


def profile_stage(module, example, loss_fn, ids, repeats: int, barrier: bool = True) -> tuple[float, float]:
    """Median seconds of one micro-batch's forward (with the loss on the last stage) and backward on this stage."""
    import torch
    import torch.distributed as dist

    forward, backward = [], []
    for i in range(repeats + 1):
        x = example.detach().requires_grad_(example.is_floating_point())
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        out = module(x)
        if loss_fn is not None:
            out = loss_fn(out, ids[: out.shape[0]])
        middle = time.perf_counter()
        out.backward(None if loss_fn is not None else torch.ones_like(out))
        end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if i:  # the first is a warmup
            forward.append(middle - start)
            backward.append(end - middle)
    return statistics.median(forward), statistics.median(backward)


def ping_pong(tensor, repeats: int) -> float:
    """One-way seconds of sending `tensor` between ranks 0 and 1 (half the median round trip)."""
    import torch.distributed as dist

    rank, trips = dist.get_rank(), []
    buffer = tensor.clone()
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(tensor, 0)
        if i:
            trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2 if rank == 0 else 0.0


def measure(processes: int, args: argparse.Namespace) -> dict:
    """Run `worker` under torchrun on `processes` CPU processes; return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            SCRIPT, "--worker", "--worker-out", str(out), "--preset", args.preset,
            "--microbatches", str(args.microbatches), "--rounds", str(args.rounds), "--repeats", str(args.repeats),
        ]  # fmt: skip
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def predict(run: dict) -> dict:
    """Per schedule: the measured step times, and the simulator's step time for each round from that round's stage
    profile, taken with every process computing at once ("together") and one process at a time ("alone"), and its
    send latency; 2BW with each stage's measured optimizer step. Ratios predicted / measured per round."""
    from hf_p2r.distributed.simulate import StageCost, simulate_schedule

    stages = len(run["rounds"][0]["stages"])
    summary = {}
    for schedule in ("gpipe", "1f1b", "2bw"):
        if schedule != "gpipe" and run["microbatches"] < stages:
            continue
        measured = [r["measured_step_s"][schedule] for r in run["rounds"]]
        updates = run["two_bw_update_s"] if schedule == "2bw" else [0.0] * stages
        row = {"measured_s": measured}
        for profile in ("together", "alone"):
            predicted, bubbles = [], []
            for r in run["rounds"]:
                costs = [StageCost(*stage[profile], update=u) for stage, u in zip(r["stages"], updates)]
                sim = simulate_schedule(schedule, costs, run["microbatches"], p2p=r["p2p_s"])
                predicted.append(sim.step_time)
                bubbles.append(sim.bubble)
            row[f"predicted_{profile}_s"] = predicted
            row[f"bubble_{profile}"] = statistics.median(bubbles)
            row[f"ratio_{profile}"] = [a / b for a, b in zip(predicted, measured)]
        summary[schedule] = row
    return summary


# ---------------------------------------------------------------------------------------------------------------
# 2. At scale, on the planner's hardware
# ---------------------------------------------------------------------------------------------------------------


def gpt_config(model_name: str):
    """`GPT_MODELS[model_name]` as a real P2R config: no GQA, 2048 positions, GPT-2's vocabulary padded, untied."""
    from hf_p2r import P2RConfig

    dims = GPT_MODELS[model_name]
    return P2RConfig(
        **dims,
        num_key_value_heads=dims["num_attention_heads"],
        vocab_size=51200,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def at_scale(model_name: str, stages: int, microbatches: int) -> dict:
    """Throughput and memory of each schedule for one GPT-style model on `stages` GPUs (one pipeline, micro-batch
    of one sequence of 2048 tokens, mixed precision), the fastest setting (recompute or not) that fits."""
    from hf_p2r.distributed.simulate import StageCost, simulate_schedule
    from hf_p2r.planning import PRECISIONS, Hardware, Layout, Workload, estimate, parameter_tensors
    from hf_p2r.planning.plan import stage_seconds

    seq = 2048
    config = gpt_config(model_name)
    hardware = Hardware()
    workload = Workload(seq_len=seq, micro_batch=1, global_batch=microbatches, precision=PRECISIONS["mixed"])
    tensors = parameter_tensors(config)
    rows = {}
    for schedule in ("gpipe", "1f1b", "2bw"):
        best = None
        for recompute in (False, True):
            layout = Layout(dp=1, pp=stages, schedule=schedule, recompute=recompute)
            planned = estimate(config, layout, workload, hardware, tensors)
            times = stage_seconds(config, tensors, layout, workload, hardware)
            costs = [StageCost(f, b) for f, b in times["stages"]]
            sim = simulate_schedule(schedule, costs, microbatches, p2p=times["p2p"], batches=4)
            row = {
                "recompute": recompute,
                "fits": planned.fits,
                "gpu_gib": planned.memory.total / 2**30,
                "step_s": sim.step_time,
                "bubble": sim.bubble,
                "idle": sim.idle,
                "sequences_per_s": microbatches / sim.step_time,
                "planner_step_s": planned.step_seconds,
            }
            if planned.fits and (best is None or not best["fits"] or row["step_s"] < best["step_s"]):
                best = row
            elif best is None:
                best = row
        rows[schedule] = best
    return rows


def sweep(model_name: str, stages: int, microbatches: int) -> dict:
    """The simulator alone over d = 4 ... 64: step time, bubble and peak memory (weight versions + in-flight
    activations, as the simulator counts them along the action lists) of each schedule, no recomputation."""
    from hf_p2r.distributed.simulate import StageCost, simulate_schedule
    from hf_p2r.planning import PRECISIONS, Hardware, Layout, Workload, parameter_tensors
    from hf_p2r.planning.memory import (
        head_activation_bytes,
        layer_activation_bytes,
        logits_bytes,
        model_state_bytes,
        pipeline_stages,
        stage_tensors,
    )
    from hf_p2r.planning.plan import stage_seconds

    config, seq = gpt_config(model_name), 2048
    precision = PRECISIONS["mixed"]
    workload = Workload(seq_len=seq, micro_batch=1, global_batch=microbatches, precision=precision)
    tensors = parameter_tensors(config)
    layer = layer_activation_bytes(config, seq, 1, precision)
    head = head_activation_bytes(config, seq, precision) + logits_bytes(config, seq, precision)
    times = stage_seconds(config, tensors, Layout(dp=1, pp=stages), workload, Hardware())
    costs = []
    for stage, (forward, backward) in zip(pipeline_stages(config, stages, seq), times["stages"]):
        weights = model_state_bytes(stage_tensors(tensors, stage, False), Layout(dp=1), precision).weights
        activations = len(stage.depths) * layer + (8 * seq if stage.first else 0) + (head if stage.last else 0)
        costs.append(StageCost(forward, backward, weights=weights, activations=activations))
    rows = {}
    for schedule in ("gpipe", "1f1b", "2bw"):
        sim = simulate_schedule(schedule, costs, microbatches, p2p=times["p2p"], batches=4)
        rows[schedule] = {
            "step_s": sim.step_time,
            "bubble": sim.bubble,
            "peak_in_flight": max(sim.peak_in_flight),
            "peak_versions": max(sim.peak_versions),
            "peak_gib": max(sim.peak_bytes) / 2**30,
        }
    return rows


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step in the measured runs")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of (profile, one step per schedule)")
    parser.add_argument("--repeats", type=int, default=3, help="profile and ping-pong repetitions per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/pipeline_sim"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    load = [os.getloadavg()[0]]  # the 1-minute load average: what else was running on this machine
    measured = []
    for processes in args.processes:
        run = measure(processes, args)
        run["predicted"] = predict(run)
        measured.append(run)
    scale = {
        model: {str(d): {str(m): at_scale(model, d, m) for m in (d, 4 * d)} for d in SCALE_DEPTHS}
        for model in GPT_MODELS
    }
    sweep_rows = {str(d): sweep("gpt-13B", d, 2 * d) for d in SWEEP_DEPTHS}
    from hf_p2r.planning import Hardware

    result = {
        "date": utc_now(),
        "machine": machine(),
        "command": "python scripts/bench_pipeline_sim.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": {"name": args.preset, **PRESETS[args.preset]},
        "measured": measured,
        "load_average_1min": {"start": load[0], "end": os.getloadavg()[0]},
        "hardware": Hardware().__dict__,
        "at_scale": scale,
        "sweep": {"model": "gpt-13B", "microbatches": "2 d", "rows": sweep_rows},
    }
    write_json(args.out.with_suffix(".json"), result)
    markdown = render_markdown(result)
    write_text(args.out.with_suffix(".md"), markdown)
    print(markdown)
    return 0


def render_markdown(r: dict) -> str:
    m, p, hw = r["machine"], r["preset"], r["hardware"]
    lines = [
        "# Pipeline schedules: simulator vs measured, and PipeDream-2BW's comparison at scale",
        "",
        f"Produced by `{r['command'].strip()}` on {r['date']}. Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch "
        f"{m['torch']}, {m['platform']}.",
        "",
        "## 1. Predicted vs measured step time (CPU, gloo, one process per stage)",
        "",
        f"Real P2R model: hidden {p['hidden_size']}, FFN {p['intermediate_size']}, {p['num_attention_heads']} heads "
        f"({p['num_key_value_heads']} KV), {p['num_hidden_layers']} layers, vocab {p['vocab_size']}, fp32; "
        f"micro-batch {p['micro_batch']} x {p['seq']} tokens. Measured: hf-p2r's pipeline runtime "
        "(`hf_p2r.distributed.pipeline.build_pipeline`, equal layers per stage): torch's `ScheduleGPipe` / "
        "`Schedule1F1B` and hf-p2r's `SchedulePipeDream2BW`. Flush schedules: one `Pipeline.step()` (forward + "
        "backward of every micro-batch, no optimizer step) per round, timed between barriers. 2BW: a burst of 4 "
        "steps back to back per round (no flush, its optimizer step inside), the median interval after the first "
        "(pipeline fill). Predicted: "
        "`hf_p2r.distributed.simulate` from each stage's own forward / backward time on one micro-batch, a measured "
        "one-way send of one micro-batch's activations and (2BW) each stage's measured AdamW step, taken in the "
        "same processes in the same round (rounds interleave profile and flush steps, so a prediction and its "
        'measurement are seconds apart). Two profiles: all processes computing at once ("together") and one at a '
        'time ("alone"). Medians over rounds (min - max); ratio: predicted / measured, median over rounds.',
        "",
        "| processes | threads each | m | stage fwd/bwd ms (together; alone) | send ms | schedule | measured s "
        "| predicted s together | ratio | predicted s alone | ratio | bubble (together) |",
        "|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in r["measured"]:
        profile = {
            name: ", ".join(
                f"{statistics.median(rd['stages'][i][name][0] for rd in run['rounds']) * 1e3:.0f}/"
                f"{statistics.median(rd['stages'][i][name][1] for rd in run['rounds']) * 1e3:.0f}"
                for i in range(run["processes"])
            )
            for name in ("together", "alone")
        }
        send = statistics.median(rd["p2p_s"] for rd in run["rounds"]) * 1e3
        for schedule, row in run["predicted"].items():
            measured = row["measured_s"]
            cells = [f"{statistics.median(measured):.3f} ({min(measured):.3f} - {max(measured):.3f})"]
            for name in ("together", "alone"):
                ratios = row[f"ratio_{name}"]
                cells.append(f"{statistics.median(row[f'predicted_{name}_s']):.3f}")
                spread = f" ({min(ratios):.2f} - {max(ratios):.2f})" if len(ratios) > 1 else ""
                cells.append(f"{statistics.median(ratios):.2f}{spread}")
            lines.append(
                f"| {run['processes']} | {run['threads_per_process']} | {run['microbatches']} | "
                f"{profile['together']}; {profile['alone']} | {send:.2f} | {schedule} | "
                + " | ".join(cells)
                + f" | {max(row['bubble_together'], 0):.0%} |"
            )
    lines += [
        "",
        f"The machine has {m['cpu_count']} cores, shared with other work while this ran (1-minute load average "
        f"{r['load_average_1min']['start']:.1f} before the runs, {r['load_average_1min']['end']:.1f} after). The "
        "simulator gives every "
        "stage its own processor: with more processes than cores that is false, and the two profiles bracket the "
        'truth ("together" counts the contention of all stages computing at once, which a pipeline with a bubble '
        'does not always have; "alone" counts none).',
        "",
        "## 2. At scale: 2BW vs GPipe vs 1F1B-flush (PipeDream-2BW's comparison, arXiv 2006.09503)",
        "",
        f"Hardware: the planner's defaults (`hf_p2r.planning.Hardware`): {hw['peak_flops'] / 1e12:.0f} TFLOP/s "
        f"peak x {hw['mfu']:.0%} MFU per GPU, {hw['gpus_per_node']} GPUs per node, {hw['gpu_memory'] / 1e9:.0f} GB "
        f"each ({hw['reserved_gpu_bytes'] / 2**30:.0f} GiB reserved), sends at {hw['intra_node_bandwidth'] / 1e9:.0f} "
        f"GB/s inside a node and {hw['inter_node_bandwidth'] / 1e9:.0f} GB/s across. One pipeline of d GPUs, "
        "micro-batch 1 x 2048 tokens, m micro-batches per optimizer step, mixed precision (bf16 weights, fp32 "
        "grads and Adam), equal layers per stage (the head on the last). Stage times: `stage_seconds` (the "
        "planner's FLOP count); memory and fit: the planner's `estimate` for that schedule; each schedule uses "
        "activation recomputation only where it does not fit without (as the paper's planner decides). "
        "Throughput: simulated sequences per second (2BW in steady state).",
        "",
        "| model | d | m | schedule | recompute | GPU GiB (fits) | seq/s | vs GPipe | vs 1F1B | bubble | idle |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, by_depth in r["at_scale"].items():
        for d, by_m in by_depth.items():
            for microbatches, rows in by_m.items():
                for schedule, row in rows.items():
                    fits = "" if row["fits"] else " (does not fit)"
                    lines.append(
                        f"| {model} | {d} | {microbatches} | {schedule} | {'yes' if row['recompute'] else 'no'} | "
                        f"{row['gpu_gib']:.1f}{fits} | {row['sequences_per_s']:.1f} | "
                        f"{row['sequences_per_s'] / rows['gpipe']['sequences_per_s']:.2f}x | "
                        f"{row['sequences_per_s'] / rows['1f1b']['sequences_per_s']:.2f}x | "
                        f"{max(row['bubble'], 0):.0%} | {max(row['idle'], 0):.0%} |"
                    )
    lines += [
        "",
        "bubble: idle share of the busiest stage's step (flush bubble and send waits); idle: of all stages' time, "
        "which adds the waits of stages lighter than the last one (it also runs the 51200-word head).",
        "",
        "### The simulator from d = 4 to 64",
        "",
        f"{r['sweep']['model']} (64 layers: one per stage at d = 64), m = 2d micro-batches, no recomputation, the same "
        "hardware; peak memory as the simulator counts it along the action lists (weight versions x the stage's "
        "bf16 weights + in-flight micro-batches x the stage's saved activations; gradients and optimizer state, the "
        "same for every schedule, left out), on the most loaded stage.",
        "",
        "| d | m | schedule | step s | seq/s | bubble | peak in-flight | weight versions | peak GiB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {d} | {2 * int(d)} | {schedule} | {row['step_s']:.3f} | {2 * int(d) / row['step_s']:.1f} | "
            f"{max(row['bubble'], 0):.0%} | {row['peak_in_flight']} | {row['peak_versions']} | {row['peak_gib']:.1f} |"
            for d, rows in r["sweep"]["rows"].items()
            for schedule, row in rows.items()
        ),
        "",
        "What the paper reports, as far as our notes (../shared/notes/offload-and-distributed-anchors.md, B1) give it:",
        "",
        "| figure | paper | here |",
        "|---|---|---|",
        "| 2BW vs GPipe throughput | up to 3.2x (a secondary summary's table, marked unverified in our notes) | "
        f"{_range(r, 'gpipe')} over the rows above where GPipe fits |",
        f"| 2BW vs 1F1B-flush (PipeDream-Flush) throughput | not in our notes | {_range(r, '1f1b')} |",
        "| 2BW vs optimized baselines incl. tensor model parallelism | 1.3x - 20x (up to 20x, ICML abstract; up to "
        "6.9x in the earlier arXiv version) | not simulated (no TP baseline here) |",
        "| per-d throughputs at d = 8, 16, 32 | not in our notes | the table above |",
        "| 2BW memory per stage | 2\\|W\\|/d + \\|A_total(b)\\|/d + d \\|A_input(b)\\| with recomputation | the "
        "planner: two weight versions + 1F1B's at most d - s micro-batches of activations |",
        "",
    ]
    return "\n".join(lines)


def _range(r: dict, baseline: str) -> str:
    """2BW's throughput over `baseline`'s, lowest and highest over the rows where the baseline fits."""
    ratios = [
        rows["2bw"]["sequences_per_s"] / rows[baseline]["sequences_per_s"]
        for by_depth in r["at_scale"].values()
        for by_m in by_depth.values()
        for rows in by_m.values()
        if rows[baseline]["fits"]
    ]
    return f"{min(ratios):.2f}x - {max(ratios):.2f}x"
