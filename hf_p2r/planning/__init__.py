"""`hf-p2r plan`: memory per GPU of the pseudo and the real model under parallel layouts, and which layouts fit."""

from .memory import (
    PRECISIONS,
    Layout,
    Memory,
    ParameterTensor,
    Precision,
    layer_activation_bytes,
    model_state_bytes,
    parameter_tensors,
    pipeline_stages,
    saved_activation_bytes,
    stage_tensors,
)
from .plan import Estimate, Hardware, Workload, candidate_layouts, estimate, plan

__all__ = [
    "PRECISIONS",
    "Estimate",
    "Hardware",
    "Layout",
    "Memory",
    "ParameterTensor",
    "Precision",
    "Workload",
    "candidate_layouts",
    "estimate",
    "layer_activation_bytes",
    "model_state_bytes",
    "parameter_tensors",
    "pipeline_stages",
    "plan",
    "saved_activation_bytes",
    "stage_tensors",
]
