"""hf_p2r.compat: each private read works on the torch installed (.ci/run runs this on the floor and the newest)."""

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_p2r.compat import reshard_after_backward

from .distributed import spawn


def read_reshard_after_backward(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    block, empty = nn.Linear(4, 4), nn.Module()
    fully_shard(block, mesh=mesh)
    fully_shard(empty, mesh=mesh)
    seen = [reshard_after_backward(block)]
    for value in (False, True):
        block.set_reshard_after_backward(value)
        seen.append(reshard_after_backward(block))
    return {"seen": seen, "empty": reshard_after_backward(empty)}


def test_reshard_after_backward_reads_what_the_setter_wrote(tmp_path):
    result = spawn.run(read_reshard_after_backward, 1, tmp_path)
    assert result == {"seen": [True, False, True], "empty": True}
