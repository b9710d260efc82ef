"""The P2R model. `block_of_depth`, `delink_sources`, `source_depths` and `plan_delink` (delinks and depth growth) are
plain Python; the classes load transformers and torch on first use (PEP 562), so that `hf_p2r.models.p2r.sharing_p2r`
and `inventory_p2r` stay importable without them."""

from ...lazy import lazy_exports
from .sharing_p2r import GROWTH_PATTERNS, DelinkPlan, block_of_depth, delink_sources, plan_delink, source_depths

__getattr__, __dir__, _classes = lazy_exports(
    __name__,
    {
        ".configuration_p2r": ("P2RConfig",),
        ".modeling_p2r": ("P2RForCausalLM", "P2RModel", "P2RPreTrainedModel"),
        ".configuration_p2r_moe": ("P2RMoeConfig",),
        ".modeling_p2r_moe": ("P2RMoeForCausalLM", "P2RMoeModel", "P2RMoePreTrainedModel"),
    },
)
__all__ = [
    *_classes,
    "GROWTH_PATTERNS",
    "DelinkPlan",
    "block_of_depth",
    "delink_sources",
    "plan_delink",
    "source_depths",
]
