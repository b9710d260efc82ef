"""configs/accelerate/*.yaml read by `accelerate launch` itself, into the plugins the trainer gets (no GPU needed)."""

import json
import os
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from torch.distributed.fsdp import CPUOffloadPolicy

from hf_p2r.models.p2r.modeling_p2r import P2RDecoderLayer

from ..conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "accelerate"


def launch_env(name: str, *flags: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file configs/accelerate/NAME.yaml FLAGS train.py` gives to every
    process (what `launch_command` does, minus starting processes)."""
    argv = ["--config_file", str(CONFIGS / f"{name}.yaml"), *flags, "--main_process_port", "0", "train.py"]
    args = launch_command_parser().parse_args(argv)
    args, defaults, mixed_precision_from_file = _validate_launch_command(args)
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_file else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return prepare_deepspeed_cmd_env(args)[1]


def use_launch_env(name: str) -> None:
    """Put `launch_env(name)` into this process's environment, as `accelerate launch` would for one process, keeping
    the rank, address and port that tests/distributed/spawn.py set for the process group it joined."""
    spawned = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    os.environ.update({k: v for k, v in launch_env(name).items() if k not in spawned})


def test_every_config_is_there():
    names = {path.stem for path in CONFIGS.glob("*.yaml")}
    assert names == {"ddp", "fsdp2", "fsdp2_offload", "deepspeed_zero2", "deepspeed_zero3_offload"}


def test_ddp():
    env = launch_env("ddp")
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and "ACCELERATE_USE_FSDP" not in env
    assert "ACCELERATE_USE_DEEPSPEED" not in env


@pytest.mark.parametrize("name,offload", [("fsdp2", False), ("fsdp2_offload", True)])
def test_fsdp2_wraps_each_stored_block_once(name, offload):
    env = launch_env(name)
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == offload
    # Accelerate's own wrap policy on a pseudo model: exactly the k stored blocks become units, each one module
    # that the forward runs at several depths (never split, never wrapped twice).
    model = tiny_model(share_layers=True, num_unique_layers=2)
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = [module for module in model.modules() if policy(module)]
    assert len(units) == 2 and all(isinstance(unit, P2RDecoderLayer) for unit in units)
    assert [id(unit) for unit in units] == [id(block) for block in model.model.layers]


@pytest.mark.parametrize("name,stage,offload", [("deepspeed_zero2", 2, False), ("deepspeed_zero3_offload", 3, True)])
def test_deepspeed(name, stage, offload, monkeypatch):
    monkeypatch.chdir(ROOT)  # the YAML names its JSON relative to the repository root
    env = launch_env(name, "--mixed_precision", "bf16")
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()  # raises if the YAML sets what the JSON owns (e.g. mixed_precision)
    assert plugin.zero_stage == stage and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    zero = json.loads((ROOT / env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())["zero_optimization"]
    assert ("offload_optimizer" in zero and "offload_param" in zero) == offload
    assert plugin.deepspeed_config["gradient_clipping"] == 1.0  # DeepSpeed clips, not the trainer


def test_deepspeed_yaml_must_leave_precision_to_the_json(tmp_path, monkeypatch):
    """Why deepspeed_*.yaml have no mixed_precision key: Accelerate refuses one next to a DeepSpeed JSON."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "broken.yaml").write_text((CONFIGS / "deepspeed_zero2.yaml").read_text() + "mixed_precision: bf16\n")
    monkeypatch.setattr(__name__ + ".CONFIGS", tmp_path)
    with mock.patch.dict(os.environ, launch_env("broken")), pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin()
