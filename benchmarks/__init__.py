"""The benchmarks: one module per benchmark (the convergence benchmark a package, split by role), the harness they
share (`harness`: machine, interleaved timing, ratio summaries, result files) and their size presets (`presets`).

Each benchmark is run through its script, as every result page beside these modules names it:
`python scripts/bench_NAME.py` from the repository root (the script puts the root on `sys.path` and calls the module's
`main`). The package is not part of the wheel: pyproject's `packages.find` includes `hf_p2r*` only.
"""
