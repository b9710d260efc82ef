"""Declared = tested: the pinned sets that `make` installs and .ci/run tests agree with what pyproject.toml declares."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def declared() -> dict[str, Requirement]:
    """The dependencies and every optional extra (`dev` installs them all, test_dev_installs_every_extra: CI runs
    DeepSpeed's tests on CPU, tests/integrations/test_trl.py under TRL)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [line for name, lines in project["optional-dependencies"].items() if name != "dev" for line in lines]
    requirements = [Requirement(line) for line in [*project["dependencies"], *extras]]
    return {canonicalize_name(r.name): r for r in requirements}


def pins(path: str) -> dict[str, Version]:
    pinned = {}
    for line in (ROOT / path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"{path}: {line} is not a pin"
            pinned[canonicalize_name(requirement.name)] = Version(specifier.version)
    return pinned


def test_dev_installs_every_extra():
    """Declared = tested: an extra that `make test` did not install would be declared and never tested."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = set(extras["dev"])
    for name, lines in extras.items():
        assert set(lines) <= dev, f"pyproject.toml: the dev extra lacks the {name} extra's {sorted(set(lines) - dev)}"


def test_floors_are_pyprojects_lower_bounds():
    floors = {}
    for name, requirement in declared().items():
        lower = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        if lower:
            floors[name] = lower[0]
    assert pins("requirements/floors.txt") == floors


def test_the_tested_set_is_within_pyprojects_ranges():
    tested = pins("requirements/tested.txt")
    for name, requirement in declared().items():
        if name == "torch":
            assert name not in tested, "torch is chosen by the Makefile's TORCH (or the build put into .venv first)"
            continue
        assert name in tested, f"requirements/tested.txt does not pin {name}"
        assert requirement.specifier.contains(tested[name], prereleases=True), f"{name}=={tested[name]}"


def test_make_installs_the_tested_set():
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK   ?= requirements/tested.txt" in makefile
    assert '-m pip install --quiet -c $(LOCK) -e ".[dev]"' in makefile


def test_the_tested_set_pins_every_dev_tool_within_its_range():
    """`make test` runs on pytest-xdist and pytest-timeout (tests/tiers.py): the lock pins each dev tool, so a fresh
    clone gets the ones CI ran."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = [Requirement(line) for line in project["optional-dependencies"]["dev"]]
    assert {"pytest-xdist", "pytest-timeout"} <= {canonicalize_name(r.name) for r in dev}
    tested = pins("requirements/tested.txt")
    for requirement in dev:
        name = canonicalize_name(requirement.name)
        assert name in tested, f"requirements/tested.txt does not pin {name}"
        assert requirement.specifier.contains(tested[name], prereleases=True), f"{name}=={tested[name]}"


def test_make_says_what_it_installs_before_installing():
    """Each install in a recipe (a venv, a pip install) comes after a `make: ...` line that says what it installs,
    printed since the install before it, so a fresh `make test` or `make demo` does not sit silent for minutes."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    checked = 0
    for rule in makefile.split("\n\n"):
        said = []
        for line in (line.strip() for line in rule.splitlines() if line.startswith("\t")):
            if line.startswith("@") and 'echo "make: ' in line:
                said.append(line)
            elif " -m venv " in line or " pip install " in line:
                assert said, f"Makefile: nothing said before {line}"
                if " pip install " in line and "--upgrade pip" not in line:  # a venv and its pip: said together
                    said = []
                checked += 1
    assert checked >= 8
