"""hf-p2r: Pseudo-to-Real pretraining (M6-10T) for Hugging Face Transformers."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .checkpoint import convert_pseudo_to_real, export_llama, llama_config
from .hub import push_to_hub
from .models.p2r import P2RConfig, P2RForCausalLM, P2RModel, P2RPreTrainedModel, block_of_depth, delink_sources

__version__ = "0.1.0"

AutoConfig.register(P2RConfig.model_type, P2RConfig, exist_ok=True)
AutoModel.register(P2RConfig, P2RModel, exist_ok=True)
AutoModelForCausalLM.register(P2RConfig, P2RForCausalLM, exist_ok=True)

__all__ = [
    "P2RConfig",
    "P2RForCausalLM",
    "P2RModel",
    "P2RPreTrainedModel",
    "block_of_depth",
    "convert_pseudo_to_real",
    "delink_sources",
    "export_llama",
    "llama_config",
    "push_to_hub",
]
