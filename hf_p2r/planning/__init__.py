"""`hf-p2r plan`: memory per GPU of the pseudo and the real model under parallel layouts, and which layouts fit.

The names below load on first use (PEP 562), so that importing `hf_p2r.planning.assumptions` (all the CLI's parser
needs) does not import torch and transformers. `plan` is the function: importing the submodule of that name (which
binds a submodule to its package) leaves it so."""

import importlib
import sys
import types

_EXPORTS = {
    "assumptions": ("GiB", "PRECISIONS", "Hardware", "Precision"),
    "memory": (
        "PIPELINE_SCHEDULES",
        "Layout",
        "Memory",
        "ParameterTensor",
        "layer_activation_bytes",
        "model_state_bytes",
        "parameter_tensors",
        "pipeline_stages",
        "saved_activation_bytes",
        "stage_tensors",
    ),
    "plan": ("Estimate", "Workload", "candidate_layouts", "estimate", "plan", "stage_seconds"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Planning(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name == "plan" and isinstance(value, types.ModuleType):  # the import system binding `planning/plan.py`
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Planning
