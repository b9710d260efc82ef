"""A DCP checkpoint's weights written as safetensors one tensor at a time (`hf_p2r.checkpoint.dcp_weights`): the
files are those `write_checkpoint` writes from the whole state dict, and the memory a write takes is that of its
largest tensor, not of the model (measured in a child process on /proc/self/status, as test_memory.py does; the
control loads the whole state dict first, as an exporter that gathers it would, and the measurement sees it)."""

import filecmp
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader as TorchReader
from transformers.core_model_loading import revert_weight_conversion

from hf_p2r.checkpoint import write_checkpoint
from hf_p2r.checkpoint.dcp_weights import dcp_weights, write_dcp_weights
from hf_p2r.errors import InputError
from hf_p2r.models.p2r import P2RConfig, P2RForCausalLM
from hf_p2r.training import dcp

from ..distributed import spawn

# 8 real layers of 3.2 M parameters (12.8 MB in float32): 106 MB in all; the largest tensor is 2.9 MB.
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, vocab_size=1024, num_hidden_layers=8)


def _checkpoint(folder, **shape) -> tuple[P2RForCausalLM, dict]:
    torch.manual_seed(0)
    model = P2RForCausalLM(P2RConfig(**{**SHAPE, **shape}))
    weights = dict(model.named_parameters())
    dcp.save(folder, {"model": {name: tensor.detach() for name, tensor in weights.items()}})
    return model, weights


def test_the_files_are_those_of_the_whole_state_dict(tmp_path):
    model, weights = _checkpoint(tmp_path / "dcp", hidden_size=64, intermediate_size=128, num_attention_heads=2)
    assert dcp_weights(tmp_path / "dcp") == {name: (t.dtype, tuple(t.shape)) for name, t in weights.items()}
    (tmp_path / "whole").mkdir(), (tmp_path / "streamed").mkdir()
    write_checkpoint(tmp_path / "whole", model.state_dict(), max_shard_size="100KB", progress=False)
    with torch.device("meta"):
        skeleton = P2RForCausalLM(model.config)
    files = write_dcp_weights(
        tmp_path / "dcp", tmp_path / "streamed", skeleton.state_dict(), max_shard_size="100KB", progress=False
    )
    assert len(files) > 2  # shards and an index
    names = sorted(path.name for path in (tmp_path / "whole").iterdir())
    assert sorted(path.name for path in files) == names
    assert filecmp.cmpfiles(tmp_path / "whole", tmp_path / "streamed", names, shallow=False)[0] == names


def test_a_weight_the_checkpoint_lacks_or_shapes_otherwise_is_one_line_before_any_file(tmp_path):
    model, _ = _checkpoint(tmp_path / "dcp", hidden_size=64, intermediate_size=128, num_attention_heads=2)
    with torch.device("meta"):
        wider = P2RForCausalLM(P2RConfig(**{**SHAPE, "hidden_size": 64, "intermediate_size": 256}))
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match=r"model\.model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\], but"):
        write_dcp_weights(tmp_path / "dcp", tmp_path / "out", wider.state_dict(), progress=False)
    with pytest.raises(InputError, match=r"holds no model\.extra\.weight"):
        write_dcp_weights(tmp_path / "dcp", tmp_path / "out", {"extra.weight": torch.empty(2, device="meta")})
    assert not list((tmp_path / "out").iterdir())


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from hf_p2r.checkpoint.dcp_weights import dcp_weights, write_dcp_weights
    from hf_p2r.models.p2r import P2RConfig, P2RForCausalLM
    from pathlib import Path

    def status():
        with open("/proc/self/status") as file:
            return {k: int(v.split()[0]) * 1024 for k, _, v in (l.partition(":") for l in file) if v.endswith("kB\\n")}

    checkpoint, out, whole = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "whole"
    with torch.device("meta"):
        skeleton = P2RForCausalLM(P2RConfig(**json.loads(sys.argv[4])))
    tensors = skeleton.state_dict()
    dcp_weights(checkpoint)  # warm-up: DCP's modules imported
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # VmHWM := VmRSS
    base = status()["VmRSS"]
    held = {}
    if whole:  # the control: the whole state dict in memory, as an exporter that gathers it holds it
        held = {"model." + name: torch.empty(t.shape, dtype=t.dtype) for name, t in tensors.items()}
        dcp.load(held, checkpoint_id=checkpoint, no_dist=True)
    write_dcp_weights(checkpoint, out, tensors, max_shard_size="20MB", progress=False)
    print(json.dumps({"peak": status()["VmHWM"] - base}))
""")


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "control: the whole state dict"])
def test_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path, whole):
    model, weights = _checkpoint(tmp_path / "dcp")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    largest = max(t.numel() * t.element_size() for t in weights.values())
    del model, weights
    (tmp_path / "out").mkdir()
    args = [tmp_path / "dcp", tmp_path / "out", "whole" if whole else "streamed", json.dumps(SHAPE)]
    done = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], capture_output=True, text=True, check=True)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    mb = 1 << 20
    print(f"model {total / mb:.0f} MB, largest tensor {largest / mb:.1f} MB, peak RSS growth {peak / mb:.1f} MB")
    # Measured: 16 MB for this 102 MB model, about 6 times its largest tensor (2.8 MB) whatever the model's size (1.9 MB
    # for a largest tensor of 0.25 MB, 5.4 MB for 1 MB): DCP reads a piece through torch.load into a tensor of its own,
    # then copies it into the one asked for, and the allocator keeps some of what it freed.
    bound = 8 * largest + 8 * mb
    assert (peak >= total) if whole else (peak < bound < total / 3)


def _fsdp2_checkpoints(folder: str, rank: int, world: int) -> dict:
    """Each process saves its FSDP2 shards (`fully_shard_p2r` on each block and the root) of a dense and a MoE model."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_p2r.distributed import fully_shard_p2r

    from ..training.test_compile import tiny_model

    for moe in (False, True):
        model = fully_shard_p2r(tiny_model(depth=4, blocks=4, moe=moe), mesh=init_device_mesh("cpu", (world,)))
        state = dcp.model_state(model, torch.optim.AdamW(model.parameters()))["model"]
        dcp.save(Path(folder) / ("moe" if moe else "dense"), {"model": state})
    return {}


@pytest.mark.slow  # two spawned processes: 40 s on a 2-core machine
def test_fsdp2_shards_of_two_processes_write_the_files_of_the_whole_model(tmp_path):
    """Whichever layout wrote the checkpoint: here each tensor in two pieces (a MoE layer's 3-D experts split between
    the processes), written as the whole model's `save_pretrained` names them."""
    from ..training.test_compile import tiny_model

    spawn.run(functools.partial(_fsdp2_checkpoints, str(tmp_path)), 2, tmp_path)
    for kind, name in (("dense", "mlp.up_proj.weight"), ("moe", "mlp.experts.gate_up_proj")):
        checkpoint = tmp_path / kind
        chunks = TorchReader(checkpoint).read_metadata().state_dict_metadata
        assert len(chunks[f"model.model.layers.0.{name}"].chunks) == 2  # each process wrote its half
        model = tiny_model(depth=4, blocks=4, moe=kind == "moe")  # the same initial weights (its seed)
        (tmp_path / kind / "whole").mkdir(), (tmp_path / kind / "streamed").mkdir()
        write_checkpoint(checkpoint / "whole", revert_weight_conversion(model, model.state_dict()), progress=False)
        with torch.device("meta"):
            skeleton = type(model)(model.config)
        tensors = revert_weight_conversion(skeleton, skeleton.state_dict())  # the names save_pretrained writes
        write_dcp_weights(checkpoint, checkpoint / "streamed", tensors, progress=False)
        assert filecmp.cmp(checkpoint / "whole/model.safetensors", checkpoint / "streamed/model.safetensors", False)
