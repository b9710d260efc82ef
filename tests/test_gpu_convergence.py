"""The GPU report's `convergence` part (benchmarks/gpu_convergence.py, issue 39): registered, and its GPU model's size.
Its dry run (a tiny model on CPU, scratch and the recommended recipe on the same tokens, through the trainer's command
line) is checked in tests/test_gpu_report.py, from the report's own dry run (one run of the part, not two)."""

from benchmarks import gpu_convergence, gpu_report
from benchmarks.convergence.compute import recipes
from hf_p2r.models.p2r import P2RConfig
from hf_p2r.models.p2r.inventory_p2r import inventory


def test_the_part_is_registered_in_the_gpu_report():
    assert gpu_report.RUNNERS["convergence"] is gpu_convergence.part_convergence
    assert gpu_report.PARTS["convergence"][0] <= 360  # the 6 minutes of device time


def test_the_gpu_model_has_over_100m_parameters():
    f = gpu_convergence.GPU_FIELDS
    dims = {key: f[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    assert inventory(P2RConfig(**dims, vocab_size=320)).numel > 100e6
    assert gpu_convergence.recommended(f["num_hidden_layers"]) in recipes(f["num_hidden_layers"])
