"""What the benchmark smoke tests share: run a benchmark's `main` into a fresh folder and read back its report."""

import json

# The throughput benchmarks' smallest run: the tiny preset, two rounds of one step, no warm-up.
TINY_THROUGHPUT = ["--preset", "tiny", "--rounds", "2", "--steps", "1", "--warmup", "0", "--num-unique-layers", "2"]


def bench_report(bench, tmp_path_factory, name: str, argv: list[str]) -> tuple[dict, str]:
    """(the JSON result, the Markdown page) of `bench.main(argv)`, written as `name` under a fresh folder."""
    out = tmp_path_factory.mktemp("bench") / name
    assert bench.main([*argv, "--out", str(out)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()
