"""How a field of the configuration is declared and checked: one mechanism for every field.

A section is a dataclass under `@section`, huggingface_hub's `@strict` (what the model's config uses): each field is
an `option(...)`, whose metadata holds its help (the `--help` text), its checks (`at_least(0)`, `between(0, 1)`, ...:
huggingface_hub validators, run on every assignment after the type check of the annotation), a `convert` applied to a
value before it is checked (the command line and a YAML file give text and numbers), and `resume="fixed"` for a field a
checkpoint's weights depend on. A float field is checked finite as well. Whatever fails is one `ConfigError` of one
line, `field: problem` (`build`, `check_value`).

Adding a field is one `option(...)` line in its section (`hf_p2r.config.sections`): it is then a YAML key and a
`--flag` with its help, checked, recorded in checkpoints and in `train_config.yaml`, and listed by `--help`. A rule that
compares it with other fields goes in `hf_p2r.config.rules`. Plain Python (no torch, no transformers).
"""

import argparse
import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassFieldValidationError

from .. import errors
from ..errors import InputError


class ConfigError(InputError):
    """A bad configuration (exit code 2 from the trainer's command line), wherever it is found: while parsing, or at
    run time for what only the run can check (e.g. `offload: auto` with no device memory to plan for)."""


# --- declaring a field ----------------------------------------------------------------------------------------------
def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    check: Callable | tuple[Callable, ...] = (),
    convert: Callable[[Any], Any] | None = None,
    resume: Literal["free", "fixed"] = "free",
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A section's field: its default (a list is copied for each instance), its `--help` text, its `check`s (each
    raises `ValueError` naming the problem; `{name}` in a message is the field's name), an optional `convert` for raw
    values, and whether a resume may change it (`resume="fixed"`: what a checkpoint's weights, data position or
    optimizer groups depend on)."""
    if isinstance(default, list):
        default, default_factory = dataclasses.MISSING, functools.partial(list, default)
    checks = list(check) if isinstance(check, tuple) else [check]
    metadata = {"help": help, "validator": checks, "convert": convert, "resume": resume}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def section(cls: type) -> type:
    """A configuration section: `cls` as a strict dataclass (huggingface_hub's `@strict`), its float fields checked
    finite too. Use under `@dataclass`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kinds = _kinds(hints[f.name])
        if float in kinds:
            f.metadata = types.MappingProxyType({**f.metadata, "validator": [finite, *f.metadata.get("validator", [])]})
        f.type = hints[f.name]  # resolved: `@strict` type-checks against it
    return strict(cls)


def at_least(low: float) -> Callable:
    """`{name}` must be >= `low` (None passes: the field's default applies)."""
    return _bounds(low=low)


def above(low: float) -> Callable:
    """`{name}` must be > `low`."""
    return _bounds(low=low, strict_low=True)


def between(low: float, high: float, strict_low: bool = False, strict_high: bool = False) -> Callable:
    """`{name}` must lie between `low` and `high` (each bound included unless strict)."""
    return _bounds(low, high, strict_low, strict_high)


def _bounds(low=None, high=None, strict_low=False, strict_high=False) -> Callable:
    def check(value) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return  # (the type check names those)
        too_low = low is not None and (value <= low if strict_low else value < low)
        too_high = high is not None and (value >= high if strict_high else value > high)
        if too_low or too_high:
            lower = f"{low} <{'' if strict_low else '='} " if low is not None else ""
            upper = f" <{'' if strict_high else '='} {high}" if high is not None else ""
            raise ValueError(f"must satisfy {lower}{{name}}{upper}, got {short(value)}")

    return check


def finite(value) -> None:
    """A float field's value is a finite number (an integer too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    try:
        if math.isfinite(value):
            return
    except OverflowError:  # an integer past the largest float
        pass
    raise ValueError(f"expected a finite number, got {short(value)}")


# --- checking values ------------------------------------------------------------------------------------------------
def build(cls: type, values: dict[str, Any]):
    """`cls(**values)` (a section), each value converted as its field says first; `ConfigError("field: problem")` for
    the first value its field refuses."""
    converted = {name: convert(cls, name, value) for name, value in values.items()}
    try:
        return cls(**converted)
    except StrictDataclassFieldValidationError as error:
        name = _field_of(error)
        raise ConfigError(f"{name}: {problem(cls, name, converted.get(name), error.__cause__)}") from None


def assign(part, name: str, value: Any) -> None:
    """`part.name = value` (a section's field), converted and checked as `build` does."""
    value = convert(type(part), name, value)
    try:
        setattr(part, name, value)
    except StrictDataclassFieldValidationError as error:
        raise ConfigError(f"{name}: {problem(type(part), name, value, error.__cause__)}") from None


def convert(cls: type, name: str, value: Any) -> Any:
    """`value` for field `name` of section `cls` as its field takes it: its own `convert`, an integer for a float
    field as that float."""
    f = cls.__dataclass_fields__[name]
    if f.metadata.get("convert") is not None:
        value = f.metadata["convert"](value)
    kinds = _kinds(f.type)
    if float in kinds and int not in kinds and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value  # (refused as not finite)
    return value


def check_value(cls: type, name: str, value: Any) -> Any:
    """`value` converted for field `name` of section `cls` and checked by the field's declared checks (its type
    first); `ConfigError("field: problem")` if one refuses it."""
    value = convert(cls, name, value)
    for validator in cls.__validators__[name]:
        try:
            validator(value)
        except (ValueError, TypeError) as cause:
            raise ConfigError(f"{name}: {problem(cls, name, value, cause)}") from None
    return value


def problem(cls: type, name: str, value: Any, cause: BaseException | None) -> str:
    """What a message says of a refused `value`: "expected TYPE, got VALUE" for a wrong type, else the check's words
    (`{name}` the field)."""
    if isinstance(cause, TypeError) or cause is None:
        return f"expected {describe(cls.__dataclass_fields__[name].type)}, got {short(value)}"
    return one_line(str(cause).replace("{name}", name))


def _field_of(error: StrictDataclassFieldValidationError) -> str:
    match = re.match(r"Validation error for field '([^']+)'", str(error))
    return match[1] if match else "config"


def _kinds(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


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


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 8, 8, 80, 40, 80


def short(value: Any) -> str:
    """`repr(value)` for a one-line message: bounded in length and depth, whatever a file or flag held."""
    return one_line(_REPR.repr(value), limit=200)


def one_line(text: str, limit: int = 400) -> str:
    """`text` on one printable line of at most `limit` characters: `hf_p2r.errors.one_line`, every message's."""
    return errors.one_line(text, limit)


__all__ = [
    "ConfigError",
    "above",
    "assign",
    "at_least",
    "between",
    "build",
    "check_value",
    "convert",
    "describe",
    "finite",
    "one_line",
    "option",
    "section",
    "short",
    "string_to_bool",
]
