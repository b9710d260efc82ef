"""Run a test body in several local processes joined by gloo on a free loopback port (no GPU, no network)."""

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(body: Callable[[int, int], dict], world_size: int, tmp_path: Path) -> dict:
    """Call `body(rank, world_size)` in `world_size` spawned processes; return what rank 0's body returned (JSON).

    `body` must be a module-level function (spawn pickles it by name). A failure in any process fails the test with
    that process's traceback.
    """
    result = tmp_path / "rank0.json"
    mp.spawn(_worker, args=(body, world_size, free_port(), str(result)), nprocs=world_size, join=True)
    return json.loads(result.read_text())


def _worker(rank: int, body, world_size: int, port: int, result: str) -> None:
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
        dist.destroy_process_group()
