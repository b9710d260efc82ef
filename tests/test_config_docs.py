"""docs/configuration.md is what scripts/gen_config_docs.py writes from the configuration's fields, and it lists every
flag the trainer's parser takes: the reference cannot drift from the code."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_generated_one():
    gen = generator()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render(), (
        "docs/configuration.md is out of date: run python scripts/gen_config_docs.py"
    )


def test_every_flag_of_the_parser_is_a_row_and_every_row_a_flag(capsys):
    """The page's keys against the flags `--help` prints (the parser's own list), so a field the generator's walk
    missed, or a row for a field the parser does not take, fails here."""
    from hf_p2r.training import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--help"])
    flags = set(re.findall(r"^\s+--(\w+)", capsys.readouterr().out, re.M)) - {"help", "config"}
    # HfArgumentParser's --no_FIELD of a boolean that defaults to true (the page's introduction says so)
    flags = {flag for flag in flags if not (flag.startswith("no_") and flag[3:] in flags)}
    rows = set(re.findall(r"^\| `(\w+)` \|", generator().render(), re.M))
    assert len(flags) > 50 and rows == flags, (sorted(flags - rows), sorted(rows - flags))


def test_a_field_without_help_is_refused(monkeypatch):
    """The page needs each field's help: a field without it is an error naming it, not an empty row."""
    import dataclasses

    gen = generator()

    @dataclasses.dataclass
    class Section:
        documented: int = dataclasses.field(default=1, metadata={"help": "Has help."})
        bare: int = 2

    @dataclasses.dataclass
    class Root:
        section: Section = dataclasses.field(default_factory=Section)

    monkeypatch.setattr(gen, "config_root", lambda: Root)
    with pytest.raises(ValueError, match=r"Section\.bare has no help"):
        gen.render()


def test_nested_sections_become_subsections_with_their_types_and_defaults(monkeypatch):
    """The walk the configuration's restructuring into sections relies on: a dataclass inside a section is a
    subsection, keys stay flat (a repeated name is refused), types and defaults are written as YAML spells them."""
    import dataclasses
    from typing import Literal

    gen = generator()

    @dataclasses.dataclass
    class Inner:
        """Inner things."""

        choice: Literal["a", "b"] = dataclasses.field(default="a", metadata={"help": "A | B, 50%% of the time."})
        items: list[int] | None = dataclasses.field(default=None, metadata={"help": "Some items."})

    @dataclasses.dataclass
    class Outer:
        """Outer things."""

        flag: bool = dataclasses.field(default=False, metadata={"help": "A flag."})
        inner: Inner = dataclasses.field(default_factory=Inner)

    @dataclasses.dataclass
    class Root:
        outer: Outer = dataclasses.field(default_factory=Outer)

    monkeypatch.setattr(gen, "config_root", lambda: Root)
    page = gen.render()
    assert "## `outer` (Outer)\n\nOuter things.\n" in page and "### `inner` (Inner)\n\nInner things.\n" in page
    assert "| `flag` | bool | `false` | A flag. |" in page
    assert "| `choice` | one of: a, b | `a` | A \\| B, 50% of the time. |" in page
    assert "| `items` | list of int or null | `null` | Some items. |" in page

    @dataclasses.dataclass
    class Twice:
        flag: int = dataclasses.field(default=0, metadata={"help": "Again."})

    @dataclasses.dataclass
    class Clash:
        outer: Outer = dataclasses.field(default_factory=Outer)
        twice: Twice = dataclasses.field(default_factory=Twice)

    monkeypatch.setattr(gen, "config_root", lambda: Clash)
    with pytest.raises(ValueError, match=r"Twice\.flag: a second field of that name"):
        gen.render()
