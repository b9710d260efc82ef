"""What the benchmark smoke tests share: run a benchmark's `main` into a fresh folder and read back its report."""

import json
import statistics

import pytest

# The throughput benchmarks' smallest run: the tiny preset, two rounds of one step, no warm-up.
TINY_THROUGHPUT = ["--preset", "tiny", "--rounds", "2", "--steps", "1", "--warmup", "0", "--num-unique-layers", "2"]


def bench_report(bench, tmp_path_factory, name: str, argv: list[str]) -> tuple[dict, str]:
    """(the JSON result, the Markdown page) of `bench.main(argv)`, written as `name` under a fresh folder."""
    out = tmp_path_factory.mktemp("bench") / name
    assert bench.main([*argv, "--out", str(out)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def report_fixture(bench, name: str, argv: list[str]):
    """A module-scoped fixture of `bench_report(bench, ..., name, argv)`: the benchmark runs once for a test module."""

    @pytest.fixture(scope="module")
    def report(tmp_path_factory) -> tuple[dict, str]:
        return bench_report(bench, tmp_path_factory, name, argv)

    return report


def assert_ratios_follow_from_the_rates(result: dict, baseline: str, real: str, pseudo: str) -> None:
    """A throughput report's ratios (real / `baseline`, pseudo / real): median, min and max of the per-round ratios of
    the tokens/s it measured for the three models."""
    rates = result["tokens_per_s"]
    assert set(rates) == {baseline, real, pseudo}
    for key, (a, b) in {f"ratio_real_vs_{baseline}": (real, baseline), "ratio_pseudo_vs_real": (pseudo, real)}.items():
        per_round = [x / y for x, y in zip(rates[a], rates[b])]
        assert result[key]["median"] == pytest.approx(statistics.median(per_round))
        assert (result[key]["min"], result[key]["max"]) == pytest.approx((min(per_round), max(per_round)))
