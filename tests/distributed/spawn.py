"""Run a test body in several local processes joined by gloo on a free loopback port (no GPU, no network)."""

import functools
import gc
import json
import multiprocessing
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_p2r.training.dcp import release_background_group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The environment of every process these CPU tests start (spawned workers, `accelerate launch`, scripts): no GPU.
# On a machine with CUDA, libraries pick `cuda:<local rank>` even for a gloo run on CPU tensors (torch's barrier,
# which Accelerate's `wait_for_everyone` calls with `device_ids=[local rank]`; transformers' tensor parallelism; FSDP2's
# default mesh), and with fewer GPUs than processes rank 1 fails with "CUDA error: invalid device ordinal", then its
# peers with gloo's "connection closed by peer". CUDA reads the variable when it starts, so it is set before.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


# The workers are forked from one server process that imported these once (multiprocessing's forkserver), not each
# started as a fresh interpreter that imports torch, transformers, Accelerate and the trainer again (spawn): that
# import cost 10-12 CPU seconds per worker, most of a small test's time (test_spawn.py's three two-process tests:
# 1.4-1.5 CPU s each after the first, against 23-25 spawned). Each worker then takes this process's environment,
# working folder and module path as they are at the call, as a spawned one would; what the modules below read from
# the environment as they are imported, they read from the first call's.
PRELOAD = ["torch", "torch.distributed", "transformers", "accelerate", "hf_p2r.training.train", "hf_p2r.distributed"]


def run(body: Callable[[int, int], dict], world_size: int, tmp_path: Path) -> dict:
    """Call `body(rank, world_size)` in `world_size` CPU processes (`CPU_ONLY`); return what rank 0's body returned
    (JSON).

    `body` must be a module-level function (it is pickled by name). A failure in any process fails the test with that
    process's traceback.
    """
    result = tmp_path / "rank0.json"
    with _environment(CPU_ONLY):
        start = dict(environment=dict(os.environ), cwd=os.getcwd(), path=list(sys.path))
        multiprocessing.set_forkserver_preload(PRELOAD)
        mp.start_processes(
            _worker,
            args=(body, world_size, free_port(), str(result), start),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
    return json.loads(result.read_text())


def shared_folder() -> str:
    """A temporary folder rank 0 makes, its path on every rank (call it on every rank)."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    return folder[0]


def shared_run(body: Callable[[int, int], dict] | dict[str, Callable[[int, int], dict]], world_size: int):
    """A module-scoped fixture: one `run(body, world_size)` whose result every test of the module reads (process
    start-up and set-up dominate a small test's time). `two = shared_run(two_processes, 2)` in a test module; with a
    dict of bodies, one run calls each in turn and returns {name: what it returned}."""
    if isinstance(body, dict):
        body = functools.partial(_each, body)
    import pytest  # here, not at the top: every spawned worker imports this module, none needs pytest

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory) -> dict:
        return run(body, world_size, tmp_path_factory.mktemp("shared-run"))

    return fixture


def _each(bodies: dict, rank: int, world_size: int) -> dict:
    return {name: body(rank, world_size) for name, body in bodies.items()}


@contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _worker(rank: int, body, world_size: int, port: int, result: str, start: dict) -> None:
    os.environ.clear()
    os.environ.update(start["environment"])
    os.chdir(start["cwd"])
    sys.path[:] = start["path"]
    os.environ.update(
        HF_HUB_OFFLINE="1", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)  # two processes share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        output = body(rank, world_size)
        if rank == 0:
            Path(result).write_text(json.dumps(output))
    finally:
        # Cycles that hold gloo's objects (a pipeline and its schedule) collected now, not during the interpreter's
        # exit, where gloo aborts the process (SIGABRT, "terminate called without an active exception").
        release_background_group()  # checkpoint_async's gloo group, likewise
        gc.collect()
        dist.destroy_process_group()
