"""`hf-p2r plan`: memory per GPU of the pseudo and the real model under parallel layouts, and which layouts fit.

The names below load on first use (PEP 562), so that importing `hf_p2r.planning.assumptions` (all the CLI's parser
needs) does not import torch and transformers. `plan` is the function: importing the submodule of that name (which
binds a submodule to its package) leaves it so."""

import sys
import types

from ..lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".assumptions": ("GiB", "PRECISIONS", "Hardware", "Precision"),
        ".memory": (
            "PIPELINE_SCHEDULES",
            "block_parameters",
            "HostMemory",
            "Layout",
            "Memory",
            "ParameterTensor",
            "layer_activation_bytes",
            "model_state_bytes",
            "parameter_tensors",
            "host_memory_per_process",
            "pipeline_stages",
            "real_parameters",
            "saved_activation_bytes",
            "stage_tensors",
        ),
        ".plan": ("Estimate", "Workload", "candidate_layouts", "estimate", "plan", "stage_seconds"),
    },
)


class _Planning(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name == "plan" and isinstance(value, types.ModuleType):  # the import system binding `planning/plan.py`
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Planning
