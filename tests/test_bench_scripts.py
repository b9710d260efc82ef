"""The commands every result page names, `python scripts/bench_NAME.py`, run their benchmark from the `benchmarks`
package whatever the working directory (each script puts the repository's root on sys.path)."""

import subprocess
import sys

from benchmarks.harness import REPO

SCRIPTS = sorted((REPO / "scripts").glob("bench_*.py"))

# Each script as `python SCRIPT --help` runs it, in one process (one start-up of torch for all of them).
HELP_OF_EACH = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), (path, exit.code)
    else:
        raise AssertionError(f"{path} --help did not exit")
"""


def test_every_script_runs_its_benchmark_from_any_folder(tmp_path):
    assert SCRIPTS
    done = subprocess.run(
        [sys.executable, "-c", HELP_OF_EACH, *map(str, SCRIPTS)],
        cwd=tmp_path,  # not the repository: `benchmarks` is found through the script's own path
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for script in SCRIPTS:
        assert f"usage: {script.name}" in done.stdout
