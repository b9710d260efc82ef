"""How long a DCP checkpoint save blocks the training loop: synchronous (`dcp.save`) against asynchronous
(`checkpoint_async`: `dcp.async_save`, the state copied to CPU memory, the shards written by a background thread).

One CPU process saves a ~100 MB model (fp32 weights) with its AdamW state (two moments: a ~300 MB checkpoint) through
the trainer's own save protocol (`hf_p2r.training.resume.checkpoints.save_checkpoint` with the Accelerate engine's
`model_state` and `hf_p2r.training.resume.dcp.save`), in interleaved rounds. For each save it times what the loop waits
for: the synchronous save whole; the asynchronous save's return (the copy to CPU memory), then training steps run
while the background thread writes (their time against steps with no write: what the write takes from them), then
what is left to wait for at the next save (`finish_checkpoint`).

    python scripts/bench_async_save.py                     # writes benchmarks/async_save.{json,md}
    python scripts/bench_async_save.py --width 256 --rounds 1 --out /tmp/a   # smoke run
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from benchmarks.harness import REPO, machine, utc_now, write_json, write_text
from hf_p2r.training.config import parse_config
from hf_p2r.training.resume.checkpoints import TrainState, checkpoint_writing, finish_checkpoint, save_checkpoint
from hf_p2r.training.resume.dcp import model_state
from hf_p2r.training.resume.dcp import save as save_dcp

COMMAND = "python scripts/bench_async_save.py"


def build(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8, width)
    step(model, optimizer, batch)  # AdamW's state exists: it is saved
    return model, optimizer, batch


def step(model, optimizer, batch) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args) -> dict:
    model, optimizer, batch = build(args.width, args.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    accelerator = Accelerator(cpu=True)
    rounds = {"sync_s": [], "async_return_s": [], "async_write_s": [], "async_left_s": [], "steps_during_write": []}
    plain, during = [], []

    def write(folder: Path) -> None:
        save_dcp(folder, model_state(model, optimizer))

    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for index in range(args.rounds):
            for asynchronous in (False, True):
                output_dir = Path(scratch) / f"run-{index}-{asynchronous}"
                argv = ["--output_dir", str(output_dir), "--checkpoint_format", "dcp", "--save_total_limit", "1"]
                config = parse_config(argv + ["--checkpoint_async", str(asynchronous).lower()])
                for _ in range(3):  # steps with no write
                    started = time.perf_counter()
                    step(model, optimizer, batch)
                    plain.append(time.perf_counter() - started)
                started = time.perf_counter()
                save_checkpoint(accelerator, output_dir, TrainState(step=index + 1), config, write=write)
                returned = time.perf_counter() - started
                if not asynchronous:
                    rounds["sync_s"].append(returned)
                    continue
                rounds["async_return_s"].append(returned)
                count = 0
                while checkpoint_writing():
                    begun = time.perf_counter()
                    step(model, optimizer, batch)
                    during.append(time.perf_counter() - begun)
                    count += 1
                rounds["async_write_s"].append(time.perf_counter() - started)
                begun = time.perf_counter()
                finish_checkpoint(accelerator)
                rounds["async_left_s"].append(time.perf_counter() - begun)
                rounds["steps_during_write"].append(count)
    median = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "weights_bytes": weights,
        "checkpoint_bytes": 3 * weights,
        "step_s": statistics.median(plain),
        "step_during_write_s": statistics.median(during) if during else None,
        "median": median,
        "rounds": rounds,
    }


def markdown(result: dict, command: str) -> str:
    m = result["median"]
    mb = result["weights_bytes"] / 1e6
    during = result["step_during_write_s"]
    slower = f"{during * 1e3:.1f} ms ({during / result['step_s']:.2f}x)" if during else "none ran"
    lines = [
        "# How long a checkpoint save blocks the training loop: synchronous against asynchronous DCP",
        "",
        f"Produced by `{command}` on {result['machine']['cpu']} ({result['date']}); one CPU process, a model of "
        f"{mb:.0f} MB of fp32 weights with its AdamW state ({result['checkpoint_bytes'] / 1e6:.0f} MB checkpoint), "
        f"median of {len(result['rounds']['sync_s'])} interleaved rounds, written to {result['scratch']}; load average "
        f"{result['load_average'][0]:.1f} on {os.cpu_count()} cores at the end.",
        "",
        "| save | training loop blocked | write done after |",
        "|---|---|---|",
        f"| synchronous (`dcp.save`) | {m['sync_s']:.3f} s | {m['sync_s']:.3f} s |",
        f"| asynchronous (`checkpoint_async`) | {m['async_return_s']:.3f} s (the copy to CPU memory) "
        f"+ {m['async_left_s']:.3f} s left at the next save | {m['async_write_s']:.3f} s |",
        "",
        f"Training steps run during the background write: {m['steps_during_write']:.0f} per save (median), each "
        f"{slower} against {result['step_s'] * 1e3:.1f} ms with no write (the write thread shares the process's "
        'cores and its GIL with the loop). The write\'s end is seen between steps: "write done after" is rounded up '
        "to a step.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(sys.argv[0]).name, description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="Linear layers' width (2048 x 6 layers: 100 MB).")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scratch", default=None, help="Where the checkpoints are written (default: the temp dir).")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks", help="Folder of async_save.{json,md}.")
    args = parser.parse_args(argv)
    result = measure(args)
    result.update(
        machine=machine(),
        date=utc_now(),
        scratch=args.scratch or tempfile.gettempdir(),
        width=args.width,
        load_average=os.getloadavg(),  # other work on the machine meanwhile: the figures are only as quiet as it
    )
    command = COMMAND + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv or sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "async_save.json", result)
    text = markdown(result, command)
    write_text(args.out / "async_save.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
