"""The P2R model. `block_of_depth` and `delink_sources` are plain Python; the classes load transformers and torch on
first use (PEP 562), so that `hf_p2r.models.p2r.sharing_p2r` stays importable without them."""

import importlib

from .sharing_p2r import block_of_depth, delink_sources

_CLASSES = {
    "P2RConfig": ".configuration_p2r",
    "P2RForCausalLM": ".modeling_p2r",
    "P2RModel": ".modeling_p2r",
    "P2RPreTrainedModel": ".modeling_p2r",
    "P2RMoeConfig": ".configuration_p2r_moe",
    "P2RMoeForCausalLM": ".modeling_p2r_moe",
    "P2RMoeModel": ".modeling_p2r_moe",
    "P2RMoePreTrainedModel": ".modeling_p2r_moe",
}


def __getattr__(name: str):
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_CLASSES, "block_of_depth", "delink_sources"]
