"""Granular CPU offload (M6-10T's second technique), applied to a model from outside it, a module per job:

- `estimates`: which blocks (`select_layers`: indices, a ratio, `auto` within a budget) and what a choice costs in
  device and host memory (`estimate_device_bytes`, `estimate_host_bytes`, `offload_working_set_bytes`, the
  planner's formula too);
- `placement`: each offloaded block's one (pinned) host allocation, everything else on the compute device;
- `fetch`: the hooks that copy a block in just before it runs and release it after;
- `gradients`: the gradient path to the host (or the sums on the device, sent once per step) and the clip that needs
  no pass over it;
- `step`: the optimizer step of the offloaded parameters (on the host after the backward, during it, or delayed by a
  step; or on the device in chunks);
- `granular`: `GranularOffload`, which puts them together;
- `step_time`: a model of the offloaded step's time from the device's compute, the bus and the host's measured rates
  (torch-free: the planner uses it).

The trainer's adapter (`hf_p2r.training.offload.apply_offload`) builds one from the run's configuration. Names load
on first use (PEP 562).
"""

from ...lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".estimates": (
            "DEFAULT_BUDGET_FRACTION",
            "GRADIENT_ACCUMULATIONS",
            "decoder_layers",
            "estimate_device_bytes",
            "estimate_host_bytes",
            "execution_order",
            "measure_activation_bytes",
            "offload_working_set_bytes",
            "select_layers",
            "spread_layers",
        ),
        ".granular": ("GranularOffload",),
        ".step": ("DEFAULT_CHUNK_BYTES", "OPTIMIZER_STEPS", "UPDATES"),
        ".step_time": ("HostRates", "OffloadStep", "predict_step_seconds"),
    },
)
