"""The planner's bytes against tensors measured on real (tiny) models, and against Megatron-LM's published formula."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import presets
from hf_p2r import P2RConfig
from hf_p2r.planning import (
    PRECISIONS,
    Layout,
    model_state_bytes,
    parameter_tensors,
    pipeline_stages,
    saved_activation_bytes,
    stage_tensors,
)
from hf_p2r.planning.memory import tp_plan

from ..conftest import tiny_config, tiny_model
from ..models.test_modeling_p2r_moe import moe_config

MODELS = {
    "real": {},
    "pseudo": {"share_layers": True, "num_unique_layers": 2},
    "pseudo-tied": {"share_layers": True, "num_unique_layers": 1, "tie_word_embeddings": True},
    "real-bias": {"attention_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize(
    "config",
    [
        *(tiny_config(**fields) for fields in MODELS.values()),
        moe_config(share_layers=True, num_unique_layers=2, decoder_sparse_step=2, mlp_bias=True),
    ],
    ids=[*MODELS, "moe"],
)
def test_parameter_tensors_and_tp_plan_are_the_meta_models(config):
    """The planner counts from the model's inventory and the TP plan transformers would assemble, without building
    the model: both are the meta-device model's."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert tp_plan(config) == model.tp_plan
    planned = [(t.name, t.shape) for t in parameter_tensors(config)]
    assert planned == [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def measured_model_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Bytes of the parameters, their gradients and the optimizer state, as allocated (shared tensors once)."""
    parameters = list(model.parameters())  # deduplicates tied and shared parameters
    weights = sum(p.numel() * p.element_size() for p in parameters)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in parameters)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    return weights, grads, state


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_model_state_bytes_match_allocated_tensors(name, dtype, precision, input_ids):
    model = tiny_model(**MODELS[name]).to(dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()

    estimate = model_state_bytes(parameter_tensors(model.config), Layout(dp=1), PRECISIONS[precision])
    assert (estimate.weights, estimate.grads, estimate.optimizer) == measured_model_states(model, optimizer)


def test_pseudo_model_states_are_the_real_blocks_times_k_over_l():
    precision, layout = PRECISIONS["mixed"], Layout(dp=1)
    pseudo = [t for t in parameter_tensors(tiny_config(share_layers=True, num_unique_layers=2)) if t.block is not None]
    real = [t for t in parameter_tensors(tiny_config()) if t.block is not None]
    pseudo_bytes = model_state_bytes(pseudo, layout, precision).model_states
    assert pseudo_bytes * 8 == model_state_bytes(real, layout, precision).model_states * 2


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_saved_activation_bytes_match_autograd(share, recompute, dtype, precision):
    overrides = {"share_layers": True, "num_unique_layers": 2} if share else {}
    model = tiny_model(hidden_size=64, intermediate_size=160, vocab_size=512, **overrides).to(dtype).train()
    assert model.config._attn_implementation == "sdpa"
    if recompute:
        model.activation_checkpointing_enable()
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:  # weights are counted as model states
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    input_ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids, use_cache=False)
    expected = saved_activation_bytes(model.config, 2, 32, PRECISIONS[precision], recompute=recompute)
    assert sum(saved.values()) == expected


def gpt3_175b() -> P2RConfig:
    """GPT-3 175B's shape (Brown et al. 2020; Narayanan et al. 2021) as a Llama-style real P2R model: 96 layers,
    hidden 12288, 96 heads (no GQA), sequence 2048, vocabulary 50257 padded as Megatron-LM does to a multiple of
    128 x TP = 1024 (51200), untied embeddings, and a SwiGLU MLP of 32768 = 8h/3 so that the MLP keeps GPT-3's 8h^2
    parameters (175.2B in all)."""
    shape = presets.model(hidden=12288, ffn=32768, heads=96, kv_heads=96, layers=96, vocab=51200)
    return P2RConfig(**shape, max_position_embeddings=2048)


def megatron_most_loaded_shard(h: int, layers: int, vocab: int, ffn: int, tp: int, pp: int) -> float:
    """`num_parameters_on_most_loaded_model_shard` of Megatron-LM's `theoretical_memory_usage.py` for a model with
    SwiGLU, RMSNorm, no GQA and untied embeddings: (transformer block / PP + embedding) / TP."""
    per_layer = 2 * h * (ffn * 3 / 2 + 1) + 2 * h * h * 2
    block = per_layer * layers + h  # + final RMSNorm
    return (block / pp + h * vocab) / tp


@pytest.mark.parametrize("zero,bytes_per_parameter", [(0, 18), (1, 6 + 12 / 8)])
def test_gpt3_175b_model_states_follow_megatron_formula(zero, bytes_per_parameter):
    config, tp, pp, dp = gpt3_175b(), 8, 16, 8
    tensors = parameter_tensors(config)
    assert sum(t.numel for t in tensors) == 175_206_838_272
    first = pipeline_stages(config, pp)[0]  # the embedding stage, Megatron's most loaded shard
    held = stage_tensors(tensors, first, tied=False)
    layout = Layout(dp=dp, tp=tp, pp=pp, zero=zero)
    memory = model_state_bytes(held, layout, PRECISIONS["mixed"])
    on_gpu = sum(t.numel // tp if t.tp_dim is not None else t.numel for t in held)

    # Mixed-precision Adam: 18 bytes per parameter unsharded; 6 + 12/DP with the distributed optimizer (ZeRO-1).
    assert memory.model_states == on_gpu * bytes_per_parameter
    # Megatron's parameter count divides everything by TP; the TP plan keeps RMSNorm weights whole on every TP rank
    # (6 layers x 2 norms here), and Megatron spreads the final norm over the PP stages. That is the whole gap:
    h = config.hidden_size
    norms = 6 * 2 * h
    megatron = megatron_most_loaded_shard(h, 96, config.vocab_size, config.intermediate_size, tp, pp)
    assert on_gpu - megatron == norms - (norms + h / pp) / tp
