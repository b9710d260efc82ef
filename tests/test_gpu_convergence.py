"""The GPU report's `convergence` part (benchmarks/gpu_convergence.py, issue 39) in its dry run: a tiny model on CPU,
scratch and the recommended recipe on the same tokens, through the trainer's command line, writing what the GPU run
writes (its figures are not results)."""

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


def test_the_dry_run_trains_both_runs_on_the_same_tokens_and_compares_their_flops(tmp_path):
    record = gpu_convergence.part_convergence(tmp_path, dry=True, limit=900)  # (a shared machine starts slowly)
    assert record["status"] == "ok", record["output_tail"]
    result = record["result"]
    scratch, grown = result["runs"]
    assert [row["name"] for row in result["runs"]] == ["scratch", result["recipe"]]
    assert scratch["steps"] == grown["steps"] == gpu_convergence.DRY_STEPS
    assert scratch["tokens"] == grown["tokens"]  # the same tokens
    assert 0 < grown["flops"] < scratch["flops"]  # its shallow steps cost less
    assert result["target"] == scratch["final_val_loss"] and result["parameters"] > 0
    assert len(grown["flops_curve"]) >= 3
