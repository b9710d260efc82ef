"""The torch-free inventory of a model's tensors against the model itself: names, shapes and order of the model built
on the meta device, on-disk names and shapes against what save_pretrained writes, and the FLOP counts."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_p2r.models.p2r.inventory_p2r import inventory

from ..conftest import tiny_config
from .test_modeling_p2r_moe import moe_config

LAYOUTS = {
    "real": {},
    "pseudo k=2": dict(share_layers=True, num_unique_layers=2),
    "pseudo sequence, tied, biases, head_dim": dict(
        share_layers=True,
        num_unique_layers=4,
        sharing_pattern="sequence",
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=16,
    ),
    "real, tied, MHA": dict(tie_word_embeddings=True, num_key_value_heads=4),
}
MOE_LAYOUTS = {
    "real": {},
    "pseudo k=1": dict(share_layers=True, num_unique_layers=1),
    "pseudo k=2, every 2nd sparse, biases": dict(
        share_layers=True, num_unique_layers=2, decoder_sparse_step=2, attention_bias=True, mlp_bias=True
    ),
    "real, dense depths 0-1, tied, groups": dict(
        mlp_only_layers=[0, 1], tie_word_embeddings=True, num_experts=6, num_experts_per_tok=3, num_expert_groups=3
    ),
}
CONFIGS = {f"dense {name}": tiny_config(**fields) for name, fields in LAYOUTS.items()}
CONFIGS |= {f"moe {name}": moe_config(**fields) for name, fields in MOE_LAYOUTS.items()}


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_the_inventory_is_the_meta_models_parameters(config):
    """Names, shapes and order of `named_parameters()` (tied once), from config.json's dict and from the config."""
    model = meta_model(config)
    expected = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    for source in (json.loads(config.to_json_string()), config):
        assert list(inventory(source).shapes().items()) == expected
    assert inventory(config).numel == model.num_parameters()
    blocks = {b: {n for n, _ in expected if n.startswith(f"model.layers.{b}.")} for b in range(config.num_blocks)}
    assert [{t.name for t in piece.tensors} for piece in inventory(config).blocks] == list(blocks.values())


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_a_delinked_inventory_is_the_delinked_models(config):
    if not config.share_layers:
        pytest.skip("a real model has nothing to delink")
    with torch.device("meta"):
        real = meta_model(config).delink()
    shapes = inventory(json.loads(config.to_json_string()), config.num_hidden_layers).shapes()
    assert list(shapes.items()) == [(name, tuple(p.shape)) for name, p in real.named_parameters()]


@pytest.mark.parametrize(
    "name", ["dense pseudo sequence, tied, biases, head_dim", "moe pseudo k=2, every 2nd sparse, biases"]
)
def test_on_disk_names_are_what_save_pretrained_writes(tmp_path, name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as file:
        written = {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118
    planned = inventory(config).disk_shapes()
    assert planned == written
    assert inventory(config).disk_count == len(planned)


def test_flops_follow_palms_count():
    """6 per matrix product weight a token uses, 12 s q per depth for attention scores, 6 h V for the head (tied or
    not); norms, biases and the embedding lookup cost nothing."""
    config = tiny_config(attention_bias=True, tie_word_embeddings=True, head_dim=16)
    inv = inventory(config)
    h, q, kv, i, v = 32, 4 * 16, 2 * 16, 64, 101
    block = 6 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    assert [piece.flops for piece in inv.blocks] == [block] * 8
    assert inv.depth_flops(3, seq_len=10) == block + 12 * 10 * q
    assert (inv.embeddings.flops, inv.head.flops) == (0, 6 * h * v)
    assert inv.flops(10) == 8 * (block + 12 * 10 * q) + 6 * h * v


def test_moe_flops_count_the_routed_experts_and_memory_all():
    config = moe_config(num_experts=4, num_experts_per_tok=2)
    inv = inventory(config)
    experts = 4 * (2 * 48 * 32 + 32 * 48)
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32
    router = 4 * 32
    assert inv.blocks[0].flops == 6 * (attention + router + experts / 2)
    assert inv.blocks[0].numel == attention + router + experts + 2 * 32
    assert inv.blocks[0].active_numel == attention + router + experts / 2 + 2 * 32


def test_the_inventory_needs_no_torch():
    code = (
        "import sys; from hf_p2r.models.p2r.inventory_p2r import inventory; "
        "inventory({'model_type': 'p2r_moe', 'num_hidden_layers': 4}).disk_shapes(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
