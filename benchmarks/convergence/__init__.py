"""The convergence benchmark (`scripts/bench_convergence.py`), by role: `analysis` (arithmetic on validation curves),
`runs` (presets, the carry study's runs and running them), `sweeps` (issue 13's sweeps), `report` (the study's page and
curves), `sweep_report` (convergence.md and its plots), `cli` (the command line). The MoE study
(`benchmarks.moe_convergence`) takes the same runs and page."""
