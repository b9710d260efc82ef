from .configuration_p2r import P2RConfig, block_of_depth, delink_sources
from .modeling_p2r import P2RForCausalLM, P2RModel, P2RPreTrainedModel

__all__ = ["P2RConfig", "P2RForCausalLM", "P2RModel", "P2RPreTrainedModel", "block_of_depth", "delink_sources"]
