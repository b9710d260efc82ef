"""What every benchmark shares: this machine's description, timing training steps in interleaved rounds, ratio
summaries over rounds, byte counts of tensors, and writing the result files (JSON, Markdown, PNG)."""

import datetime
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def utc_now() -> str:
    """The time now, UTC, to the second: `2026-01-01T00:00:00+00:00`."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows where it has none."""
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> dict:
    """This machine and its software: platform, CPU, cores, torch threads, Python, torch, and the GPU if CUDA has
    one."""
    info = {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer`'s state (AdamW: its two moments; step counters too where they are
    tensors)."""
    return nbytes(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


class Runner:
    """One model + optimizer + batch; `run(steps)` times `steps` training steps."""

    def __init__(self, name: str, model: torch.nn.Module, batch: torch.Tensor, device: str, autocast_dtype):
        self.name, self.batch, self.device, self.autocast_dtype = name, batch, device, autocast_dtype
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.tokens_per_s: list[float] = []

    def step(self) -> None:
        with torch.autocast(self.device, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            loss = self.model(self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep grads allocated: the state measured is the training state

    def run(self, steps: int) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        rate = steps * self.batch.numel() / (time.perf_counter() - start)
        self.tokens_per_s.append(rate)
        return rate


def interleave(runners: list[Runner], rounds: int, steps: int, warmup: int) -> dict[str, Runner]:
    """Warm every runner up untimed, then time `steps` steps of each per round, the order rotating round by round so
    no model always runs first (caches, clock boost); returns the runners by name."""
    for runner in runners:
        for _ in range(warmup):
            runner.step()
        runner.tokens_per_s.clear()
    for round_idx in range(rounds):
        shift = round_idx % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.run(steps)
        rates = ", ".join(f"{r.name} {r.tokens_per_s[-1]:,.0f} tok/s" for r in runners)
        print(f"round {round_idx + 1}/{rounds}: {rates}", flush=True)
    return {runner.name: runner for runner in runners}


def ratio_summary(by_name: dict[str, Runner], a: str, b: str, target: str) -> dict:
    """Median, min and max over rounds of the per-round tokens/s ratio a / b."""
    values = [x / y for x, y in zip(by_name[a].tokens_per_s, by_name[b].tokens_per_s)]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "target": target}


def write_text(path: Path, text: str) -> None:
    """`text` into `path` (its folder made if missing) through a temporary file renamed over it: an interrupted run
    leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


def write_json(path: Path, data, indent: int = 2) -> None:
    """`data` as indented JSON with a final newline, written as `write_text` writes."""
    write_text(path, json.dumps(data, indent=indent) + "\n")


def publish(out: Path, result: dict, page: str) -> str:
    """A benchmark's `result` into `out`.json and its `page` into `out`.md (each as `write_text` writes); returns the
    page (a script prints it)."""
    write_json(out.with_suffix(".json"), result)
    write_text(out.with_suffix(".md"), page)
    return page


def load_averages(r: dict) -> str:
    """A result's 1-, 5- and 15-minute load averages before / after its runs, for its page ("not recorded" where a
    result has none)."""
    if "load_average_before" not in r or "load_average_after" not in r:
        return "not recorded"
    return " / ".join(", ".join(f"{x:.2f}" for x in r[key]) for key in ("load_average_before", "load_average_after"))


def pyplot():
    """matplotlib.pyplot on its file-only backend (Agg), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(figure, path: Path, dpi: int) -> None:
    """Lay `figure` out, write it to `path` and free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
