"""How a configuration value is checked against its field and told about: the one error type, the type check of an
annotation (`matches`, `describe`), the range check, and the bounded one-line quoting of any value a file or flag held.

Plain Python (no torch, no transformers): `hf-p2r train --help` and every configuration error answer at once.
"""

import argparse
import dataclasses
import math
import reprlib
import types
import typing
from typing import Any, Literal

from ..errors import InputError


class ConfigError(InputError):
    """A bad configuration (exit code 2 from the trainer's command line), wherever it is found: while parsing, or at
    run time for what only the run can check (e.g. `offload: auto` with no device memory to plan for)."""


def string_to_bool(value: str | bool) -> bool:
    """A command-line boolean: yes/no, true/false, t/f, y/n, 1/0 (any case), as transformers' `HfArgumentParser`
    reads one."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (yes/no, 1/0), got {short(value)}")


def check_types(instance) -> None:
    """Raise `ConfigError("field: ...")` where a value does not match its annotation (the dataclasses are also built
    in code; YAML values are checked, naming the file, before they are used)."""
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if not matches(value, hints[f.name]):
            raise ConfigError(f"{f.name}: expected {describe(hints[f.name])}, got {short(value)}")


def check_range(name: str, value, low=None, high=None, strict_low=False, strict_high=False) -> None:
    """Raise `ConfigError("name: ...")` unless low <= value <= high (None passes: the field's default applies)."""
    if value is None:
        return
    too_low = low is not None and (value <= low if strict_low else value < low)
    too_high = high is not None and (value >= high if strict_high else value > high)
    if too_low or too_high:
        lower = f"{low} <{'' if strict_low else '='} " if low is not None else ""
        upper = f" <{'' if strict_high else '='} {high}" if high is not None else ""
        raise ConfigError(f"{name}: must satisfy {lower}{name}{upper}, got {short(value)}")


def matches(value, annotation) -> bool:
    """Whether `value` is of type `annotation` (unions, `Literal` choices, lists and dicts of a type; a float field
    takes an integer, never a bool or a non-finite number)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arg) for arg in args)
    if origin is Literal:
        return value in args and not (isinstance(value, bool) and not any(isinstance(arg, bool) for arg in args))
    if origin is list:
        return isinstance(value, list) and all(matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
    if annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an integer past the largest float
            return False
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def describe(annotation) -> str:
    """What a message says a field takes: "an integer", "one of 'a', 'b'", "a list (a string each) or null"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is list:
        return f"a list ({describe(args[0])} each)"
    if origin is dict:
        return "a mapping"
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 8, 8, 80, 40, 80


def short(value: Any) -> str:
    """`repr(value)` for a one-line message: bounded in length and depth, whatever a file or flag held."""
    return one_line(_REPR.repr(value), limit=200)


def one_line(text: str, limit: int = 400) -> str:
    """`text` on one printable line of at most `limit` characters (control characters escaped)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


__all__ = ["ConfigError", "check_range", "check_types", "describe", "matches", "one_line", "short", "string_to_bool"]
