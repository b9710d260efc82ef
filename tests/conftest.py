import os

# Tests never touch the network: set before transformers / huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_p2r  # noqa: E402,F401  (registers the Auto classes)
from hf_p2r import P2RConfig, P2RForCausalLM  # noqa: E402


def tiny_config(**overrides) -> P2RConfig:
    """A model small enough to build and run in milliseconds."""
    fields = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(overrides)
    return P2RConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> P2RForCausalLM:
    torch.manual_seed(seed)
    return P2RForCausalLM(tiny_config(**overrides)).eval()


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
