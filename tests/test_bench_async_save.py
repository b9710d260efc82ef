"""`python scripts/bench_async_save.py` (benchmarks/async_save.md), run small: it measures a synchronous and an
asynchronous DCP save through the trainer's save protocol and writes its page (the README names the full command,
which rewrites the committed page: tests/test_readme_commands.py excuses it for that)."""

import json
import subprocess
import sys

from benchmarks.harness import REPO


def test_the_async_save_benchmark_writes_its_page(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_async_save.py"), "--width", "256", "--rounds", "1"]
        + ["--scratch", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out/async_save.json").read_text())
    assert result["width"] == 256 and result["checkpoint_bytes"] == 3 * result["weights_bytes"] > 0
    for key in ("sync_s", "async_return_s", "async_write_s"):
        assert len(result["rounds"][key]) == 1 and result["median"][key] > 0
    assert "python scripts/bench_async_save.py" in (tmp_path / "out/async_save.md").read_text()
