"""The test suite's two tiers, and what each test costs.

`make test` runs the fast tier: every test that runs in this one process. `make test-all` adds the tests marked
`processes` (they start other processes: spawned gloo workers, `accelerate launch`, scripts, a C++ compiler for
DeepSpeed's or inductor's kernels) and the end-to-end runs marked `slow`.

Marks are given at collection (`mark_tiers`): a test is marked `processes` when its body, its fixtures or a helper
function of the tests package that they call refer to a module or function that starts processes (subprocess,
multiprocessing, tests/distributed/spawn.py, DeepSpeed). So that the marking cannot rot, every test is watched while
it runs (`ProcessWatch`): one that is not marked and still starts a process (or compiles a C++ extension) fails, with
the way it did so, in either tier.

`P2R_TEST_PROFILE=path.jsonl` appends a line per test as it ends: its CPU seconds (this process and the children it
waited for, from getrusage) and wall seconds, setup and teardown included, its tier and the processes it started
(pytest-xdist's workers append to the same file, a line at a time).
"""

import dis
import importlib
import importlib.util
import inspect
import json
import multiprocessing.process
import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

PROCESSES = "processes"

# The functions and classes that start processes (or, DeepSpeed's, build and load compiled C++ ops), by module; a
# name of these modules that starts nothing (subprocess.CalledProcessError, os.environ) marks nothing.
_PROCESS_STARTS = {"Process", "Pool", "Manager", "get_context", "spawn", "start_processes"}
_STARTERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "multiprocessing": _PROCESS_STARTS,
    "multiprocess": _PROCESS_STARTS,
    "torch.multiprocessing": _PROCESS_STARTS,
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnl", "execv", "execvp"},
    "tests.distributed.spawn": {"run"},
    "deepspeed": None,  # any use
}
# The repository's own helpers, read through for process starts: the tests package's and the benchmarks' (a benchmark's
# smoke test calls its main(), which measures each size in a fresh process).
_LOCAL = ("tests", "benchmarks")


def _local(module: str) -> bool:
    return module.split(".")[0] in _LOCAL


def _starting_names(module: str) -> set[str] | None | bool:
    """The names that start processes in `module` (None: every name), or False for a module that starts none."""
    for name, names in _STARTERS.items():
        if module == name or module.startswith(name + "."):
            return names
    return False


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _starter(function, seen: set) -> str | None:
    """How `function`, or a function of the tests package it names, starts processes (`module.name`); None if it
    names no process start."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return None
    seen.add(code)
    namespace = getattr(function, "__globals__", {})
    for inner in _code_objects(code):
        names = inner.co_names
        values = [namespace[name] for name in names if name in namespace]
        for value in [*values, *_imported(inner, namespace.get("__package__"))]:
            found = _refers(value, names, seen)
            if found:
                return found
    return None


def _imported(code: types.CodeType, package: str | None) -> list:
    """What the import statements inside `code` bind (`from ..distributed import spawn` in a test's body)."""
    values, module, level = [], None, 0
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_CONST" and isinstance(instruction.argval, int):
            level = instruction.argval
        elif instruction.opname == "IMPORT_NAME":
            name = "." * level + (instruction.argval or "")
            try:
                module = importlib.import_module(importlib.util.resolve_name(name, package) if level else name)
            except (ImportError, ValueError):
                module = None
            if module is not None:
                values.append(module)
        elif instruction.opname == "IMPORT_FROM" and module is not None:
            value = getattr(module, instruction.argval, None)
            if value is None:
                try:
                    value = importlib.import_module(f"{module.__name__}.{instruction.argval}")
                except ImportError:
                    continue
            values.append(value)
    return values


def _refers(value, names, seen: set) -> str | None:
    """How `value`, a global named by code whose names are `names`, starts processes."""
    if isinstance(value, types.ModuleType):
        starting = _starting_names(value.__name__)
        if starting is None:
            return value.__name__
        if starting:
            used = sorted(starting.intersection(names))
            return f"{value.__name__}.{used[0]}" if used else None
        if (
            _local(value.__name__) and value.__name__ != __name__
        ):  # a helper module: the functions of it this code names
            for name in names:
                attribute = getattr(value, name, None)
                if isinstance(attribute, types.FunctionType | type):
                    found = _refers(attribute, (), seen)
                    if found:
                        return found
        return None
    module = getattr(value, "__module__", None) or ""
    starting = _starting_names(module)
    if callable(value) and starting is not False:
        name = getattr(value, "__name__", "")
        if starting is None or name in starting:
            return f"{module}.{name}"
        return None
    if module == __name__:  # this plugin's own watch starts nothing
        return None
    if isinstance(value, types.FunctionType) and _local(module):
        return _starter(value, seen)
    if isinstance(value, type) and _local(module):  # a helper class: its methods
        for attribute in vars(value).values():
            found = _refers(getattr(attribute, "__func__", attribute), (), seen)
            if found:
                return found
    return None


_FOUND: dict = {}  # function -> how it starts processes (a parametrized test's items share their function)


def _starter_of_function(function) -> str | None:
    if function not in _FOUND:
        inner = getattr(getattr(function, "hypothesis", None), "inner_test", None)  # hypothesis's @given wraps it
        _FOUND[function] = _starter(function, set()) or (_starter(inner, set()) if inner else None)
    return _FOUND[function]


def starter_of(item: pytest.Item) -> str | None:
    """How `item` starts processes, by what its function, its fixtures and their helpers refer to."""
    function = getattr(item, "function", None)
    if function is not None:
        found = _starter_of_function(function)
        if found:
            return found
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for definition in fixtureinfo.name2fixturedefs.get(name, ()) if fixtureinfo else ():
            if _local(getattr(definition.func, "__module__", "")):
                found = _starter_of_function(definition.func)
                if found:
                    return f"{found} (fixture {name})"
    return None


# Each test's time limit (pytest-timeout), only to end a hang: several times what the slowest test of its tier takes on
# an idle 2-core machine, times P2R_TEST_TIME_FACTOR (e.g. 4 on a machine four times as busy; default 1).
LIMITS = {"fast": 300, "processes": 1800}


def time_factor() -> float:
    value = os.environ.get("P2R_TEST_TIME_FACTOR", "1")
    try:
        factor = float(value)
    except ValueError:
        factor = 0.0
    if not factor > 0:
        raise pytest.UsageError(f"P2R_TEST_TIME_FACTOR={value!r}: give a number above 0, e.g. 4")
    return factor


def mark_tiers(items: list[pytest.Item], limits: bool) -> None:
    """Mark `processes` the tests that start processes; with `limits`, give every test without its own `timeout` mark
    its tier's time limit."""
    factor = time_factor() if limits else 1.0
    for item in items:
        if item.get_closest_marker(PROCESSES) is None:
            found = starter_of(item)
            if found:
                item.add_marker(pytest.mark.processes(reason=f"uses {found}"))
        if limits and item.get_closest_marker("timeout") is None:
            tier = (
                "fast"
                if item.get_closest_marker(PROCESSES) is None and item.get_closest_marker("slow") is None
                else "processes"
            )
            item.add_marker(pytest.mark.timeout(LIMITS[tier] * factor))


# Hypothesis's settings. Everywhere: no per-example deadline and no too-slow health check, which a busy machine trips
# (a test's time limit is its tier's). Under CI (CI=true): at most 50 examples where a test sets no max_examples of its
# own (hypothesis's default is 100; a test's own max_examples is its bound), and a failure prints the blob that replays
# it. What a test's own settings() leave unset comes from the profile loaded when its module is imported.
HYPOTHESIS_PROFILES = {
    "p2r": dict(deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "ci": dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=50, print_blob=True),
}


def hypothesis_profile(environ=os.environ) -> str:
    return "ci" if environ.get("CI", "").strip().lower() in ("true", "1", "yes") else "p2r"


def load_hypothesis_profile(environ=os.environ) -> str:
    for name, values in HYPOTHESIS_PROFILES.items():
        settings.register_profile(name, settings.get_profile("default"), **values)  # hypothesis's defaults beneath
    name = hypothesis_profile(environ)
    settings.load_profile(name)
    return name


class ProcessWatch:
    """Records every process this one starts (subprocess, multiprocessing, os.fork/posix_spawn) and every C++
    extension it builds or loads, while a test runs."""

    def __init__(self):
        self.started: list[str] = []
        self._pid = os.getpid()
        self._patches: list[tuple[object, str, object]] = []

    def _record(self, what: str) -> None:
        if os.getpid() == self._pid:  # a forked child's starts are its own
            self.started.append(what)

    def _wrap(self, owner, name: str, describe) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self._record(describe(*args, **kwargs))
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original
        self._patches.append((owner, name, original))
        setattr(owner, name, wrapper)

    def install(self) -> None:
        def popen(popen, args, *rest, **kwargs):
            words = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
            return "subprocess " + " ".join(Path(str(w)).name if i == 0 else str(w) for i, w in enumerate(words[:4]))

        self._wrap(subprocess.Popen, "__init__", popen)
        self._wrap(multiprocessing.process.BaseProcess, "start", lambda process: f"multiprocessing {process.name}")
        for name in ("fork", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                self._wrap(os, name, lambda *args, name=name, **kwargs: f"os.{name}")
        try:
            import torch.utils.cpp_extension as cpp_extension
        except ImportError:
            return
        for name in ("load", "load_inline"):
            self._wrap(cpp_extension, name, lambda name, *args, **kwargs: f"C++ extension {name}")

    def patch_late(self) -> None:
        """`multiprocess` (datasets' multiprocessing) has its own process class; patched once it is imported."""
        module = sys.modules.get("multiprocess.process")
        if module is not None and not any(owner is module.BaseProcess for owner, _, _ in self._patches):
            self._wrap(module.BaseProcess, "start", lambda process: f"multiprocess {process.name}")

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def _cpu_seconds() -> float:
    """CPU seconds of this process and the children it waited for, and of multiprocessing's fork server (a child not
    waited for until the end, which forks tests/distributed/spawn.py's workers and waits for them) and its children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return total
        total += sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


class Tiers:
    """The pytest plugin: marks, the process watch, the per-test cost profile."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.watch = ProcessWatch()
        self.path = os.environ.get("P2R_TEST_PROFILE")
        self.checked = 0  # how many of the test's starts the guard has seen

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        mark_tiers(items, limits=self.config.pluginmanager.hasplugin("timeout"))

    def pytest_sessionstart(self, session):
        self.watch.install()

    def pytest_sessionfinish(self, session):
        self.watch.uninstall()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.watch.started.clear()
        self.checked = 0
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        if self.path:
            line = {
                "test": item.nodeid,
                "cpu_s": round(_cpu_seconds() - cpu, 3),
                "wall_s": round(time.perf_counter() - wall, 3),
                "processes": item.get_closest_marker(PROCESSES) is not None,
                "slow": item.get_closest_marker("slow") is not None,
                "started": sorted(set(self.watch.started))[:5],
                "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            }
            with open(self.path, "a") as out:  # one write of one line: workers' lines do not interleave
                out.write(json.dumps(line) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """Fails a test not marked `processes` that started a process in its set-up or its body (at the body's
        report, so it reads as the test's failure) or its tear-down."""
        outcome = yield
        self.watch.patch_late()
        report = outcome.get_result()
        if call.when == "setup" and report.passed:
            return  # judged with the body
        new, self.checked = self.watch.started[self.checked :], len(self.watch.started)
        if not new or item.get_closest_marker(PROCESSES) is not None:
            return
        started = ", ".join(sorted(set(new))[:3])
        message = (
            f"{item.nodeid} started a process ({started}) but is not marked `processes`: `make test` runs only "
            "tests that stay in their own process. Mark it @pytest.mark.processes (`make test-all` runs it), or keep "
            "it in this process."
        )
        if report.failed:  # failed for its own reason (a set-up's error included): say this too
            report.sections.append(("tests/tiers.py", message))
            return
        report.outcome = "failed"
        report.longrepr = message


def pytest_configure(config):
    config.pluginmanager.register(Tiers(config), "p2r-tiers")
