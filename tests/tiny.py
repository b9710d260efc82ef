"""The tiny model every test builds (milliseconds to build and run); no pytest here, so worker scripts that a test
starts in processes of their own (`python -m tests...`) build the same model."""

import torch

from benchmarks import presets
from hf_p2r import P2RConfig, P2RForCausalLM

# Its shape; a test that writes a config file of its own starts from it.
TINY_SHAPE = dict(
    presets.model(hidden=32, ffn=64, heads=4, kv_heads=2, layers=8, vocab=101), max_position_embeddings=64
)


def tiny_config(**overrides) -> P2RConfig:
    """A model small enough to build and run in milliseconds."""
    return P2RConfig(**{**TINY_SHAPE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides})


def tiny_model(seed: int = 0, **overrides) -> P2RForCausalLM:
    torch.manual_seed(seed)
    return P2RForCausalLM(tiny_config(**overrides)).eval()
