"""tests/tiers.py: which tests `make test` leaves to `make test-all`, and the watch that keeps that marking true."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from . import tiers
from .distributed import spawn


def _helper_that_spawns(tmp_path):
    return spawn.run(None, 2, tmp_path)


def _helper_in_process():
    return sum(range(3))


class _Fixtures:
    """The slice of pytest's fixture information `starter_of` reads."""

    def __init__(self, **functions):
        self.name2fixturedefs = {
            name: (types.SimpleNamespace(func=function, baseid=""),) for name, function in functions.items()
        }


def _item(source: str, **fixtures):
    """A test item whose function is `source`'s `body`, defined in this module's namespace (as text, so that this
    file's own tests name no process start)."""
    namespace = dict(globals())
    exec(source, namespace)
    return types.SimpleNamespace(
        function=namespace["body"], fixturenames=list(fixtures), _fixtureinfo=_Fixtures(**fixtures)
    )


def test_a_test_that_runs_a_subprocess_is_found():
    body = "import subprocess\ndef body():\n    subprocess.run(['true'], check=True)\n"
    assert tiers.starter_of(_item(body)) == "subprocess.run"
    body = "from subprocess import check_output\ndef body():\n    check_output(['true'])\n"
    assert tiers.starter_of(_item(body)) == "subprocess.check_output"


def test_a_test_that_spawns_through_a_helper_of_the_tests_is_found():
    body = "def body(tmp_path):\n    _helper_that_spawns(tmp_path)\n"
    assert tiers.starter_of(_item(body)) == "tests.distributed.spawn.run"
    body = "from .distributed import spawn\ndef body(tmp_path):\n    spawn.run(None, 2, tmp_path)\n"
    namespace = {"__name__": __name__, "__package__": __package__}
    exec(body, namespace)
    assert tiers.starter_of(types.SimpleNamespace(function=namespace["body"], fixturenames=[])) == (
        "tests.distributed.spawn.run"
    )


def test_a_fixture_that_starts_processes_marks_its_tests():
    fixture = _item("def body(tmp_path):\n    return _helper_that_spawns(tmp_path)\n").function
    fixture.__module__ = __name__  # a fixture of the tests package
    item = _item("def body(workers):\n    assert workers\n", workers=fixture)
    assert tiers.starter_of(item) == "tests.distributed.spawn.run (fixture workers)"


def test_a_name_that_starts_nothing_marks_nothing():
    body = (
        "import os, subprocess\n"
        "def body():\n"
        "    assert _helper_in_process() == 3 and os.environ is not None\n"
        "    raise subprocess.CalledProcessError(1, 'x')\n"
    )
    assert tiers.starter_of(_item(body)) is None


def test_deepspeed_marks_any_use():
    body = "import json as deepspeed\ndef body():\n    deepspeed.dumps(1)\n"  # a module named so: no import of it
    namespace = dict(globals())
    exec(body, namespace)
    namespace["deepspeed"] = types.ModuleType("deepspeed")
    assert tiers.starter_of(types.SimpleNamespace(function=namespace["body"], fixturenames=[])) == "deepspeed"


def test_this_files_tests_are_in_the_fast_tier(request):
    """The marks are on the collected items (`make test`'s `-m` selects by them): this file's stay in-process, but for
    the guard's end-to-end test and the op build's (it replaces the build process, which the marking cannot see)."""
    starters = {
        "test_an_unmarked_test_that_starts_a_process_fails",
        "test_a_build_lock_left_by_a_killed_deepspeed_build_is_removed_before_the_next_build",
    }
    for item in request.session.items:
        if item.path == request.node.path and item.name not in starters:
            assert item.get_closest_marker(tiers.PROCESSES) is None, item.name


def test_the_watch_records_each_way_of_starting_a_process():
    class Owner:
        def start(self, name):
            return name

    watch = tiers.ProcessWatch()
    watch._wrap(Owner, "start", lambda owner, name: f"owner {name}")
    try:
        assert Owner().start("one") == "one"
    finally:
        watch.uninstall()
    assert watch.started == ["owner one"] and not hasattr(Owner.start, "__wrapped__")

    watch.install()
    try:
        patched = {f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in watch._patches}
    finally:
        watch.uninstall()
    assert {"Popen.__init__", "BaseProcess.start", "os.fork", "torch.utils.cpp_extension.load"} <= patched


def test_time_limits_scale_with_the_factor(monkeypatch):
    monkeypatch.setenv("P2R_TEST_TIME_FACTOR", "4")
    assert tiers.time_factor() == 4.0
    for bad in ("0", "-1", "four"):
        monkeypatch.setenv("P2R_TEST_TIME_FACTOR", bad)
        with pytest.raises(pytest.UsageError, match="P2R_TEST_TIME_FACTOR"):
            tiers.time_factor()


def test_every_test_has_its_tiers_time_limit(request):
    if not request.config.pluginmanager.hasplugin("timeout"):
        pytest.skip("pytest-timeout is not installed")
    (limit,) = request.node.get_closest_marker("timeout").args
    assert limit == tiers.LIMITS["fast"] * tiers.time_factor()


INNER = """
import importlib

import pytest


def test_hidden():  # a start the static marking cannot see (a library's, here hidden)
    importlib.import_module("subprocess").run(["true"], check=True)


@pytest.mark.processes
def test_marked():
    importlib.import_module("subprocess").run(["true"], check=True)


def test_in_process():  # work in this process only: the guard leaves it alone
    assert importlib.import_module("json").loads("[1, 2]") == [1, 2]
"""


def test_an_unmarked_test_that_starts_a_process_fails(tmp_path):
    """The guard, end to end: pytest with this plugin on a file whose unmarked test starts a process."""
    (tmp_path / "test_inner.py").write_text(INNER)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "pytest", "-p", "tests.tiers", "-p", "no:cacheprovider", "-q", "-rf", "-n0"]
    done = subprocess.run([*command, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_inner.py::test_hidden started a process (subprocess true) but is not marked `processes`" in done.stdout
    assert "1 failed, 2 passed" in done.stdout


def test_a_hypothesis_test_is_read_through_its_wrapper():
    namespace = dict(globals())
    exec(
        "from hypothesis import given, strategies as st\n"
        "import subprocess\n"
        "@given(st.integers())\n"
        "def body(number):\n"
        "    subprocess.run(['true', str(number)])\n",
        namespace,
    )
    assert tiers.starter_of(types.SimpleNamespace(function=namespace["body"], fixturenames=[])) == "subprocess.run"


@pytest.mark.parametrize(
    ("environ", "examples"), [({"CI": "true"}, 50), ({"CI": "1"}, 50), ({}, 100), ({"CI": ""}, 100)]
)
def test_ci_bounds_the_examples_of_a_property_test_without_its_own(environ, examples):
    from hypothesis import given, settings, strategies

    before = settings.default.max_examples
    calls = []
    try:
        tiers.load_hypothesis_profile(environ)

        @given(strategies.integers())
        def body(number):
            calls.append(number)

        body()
    finally:
        settings.load_profile(tiers.hypothesis_profile())
    assert settings.default.max_examples == before  # the session's profile is back
    assert len(calls) == examples
    assert settings.default.deadline is None


def test_a_build_lock_left_by_a_killed_deepspeed_build_is_removed_before_the_next_build(tmp_path, monkeypatch):
    """torch leaves `<op>/lock` behind when a build is killed, and every later build of that folder waits on it forever
    (tests/conftest.py's op builds hung 1500 s in a CI run); the tests' builds remove it under their own file lock."""
    from . import conftest

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    seen = []

    def build(argv, **kwargs):  # the build process, not started: what it would find
        seen.append(((tmp_path / "cpu_adam" / "lock").exists(), argv[-1]))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(conftest.subprocess, "run", build)
    conftest._build_deepspeed_ops("CPUAdamBuilder")
    assert seen == [(False, "from deepspeed.accelerator import get_accelerator\n"
                     "get_accelerator().create_op_builder('CPUAdamBuilder').load()\n")]  # fmt: skip
