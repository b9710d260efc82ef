"""The trainer's command line and YAML file -> `TrainConfig`.

```bash
hf-p2r train --config configs/demo.yaml --pseudo_steps 50 --optimizer_carry copy
```

Keys are flat (as in transformers' `run_clm.py`): every field of every section (`hf_p2r.config.sections`) is both a
YAML key and a `--flag` (spelled out: no abbreviations; `--field-name` works too, and `--no_FIELD` for a flag that
defaults to true).
A list flag takes its values one after the other (`--partial_delink_blocks 2 4`); `none`, `[]` or no value clears it.
Values are layered: each field's default, then the YAML file (`--config`), then the flags typed. Every bad input,
whatever the YAML file or the command line holds, raises one `ConfigError` (a `ValueError`) of one line naming the
field, the key or the file, and the problem.

The parser is plain `argparse` built from the sections' fields (their types, defaults and help; `--help` lists them
by section), read the way transformers' `HfArgumentParser` reads them; nothing here imports torch or transformers, so
`--help` and every configuration error answer at once.
"""

import argparse
import dataclasses
import difflib
import os
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from .fields import ConfigError, check_value, one_line, short, string_to_bool
from .model_file import read_model_config
from .resume import LOCATION, STATE_FILE, different_run, resumed_values, saved_configuration
from .run import TrainConfig
from .sections import SECTION_OF, SECTIONS, ModelArguments

# The largest YAML configuration the trainer reads (the presets are a few kB).
MAX_CONFIG_BYTES = 1 << 20
DESCRIPTION = (
    "P2R pretraining: pseudo stage -> delink -> real stage. Every --FIELD is also a YAML key; a list --FIELD takes its "
    "values one after the other (none, [] or no value: an empty list)."
)


def parse_config(argv: list[str] | None = None, prog: str = "train.py") -> TrainConfig:
    """`--config FILE` (YAML, flat keys) plus `--field value` overrides -> `TrainConfig`.

    Raises `ConfigError` (a `ValueError`), one line naming the field, the YAML key and file, or the bad flag, for any
    bad input; `--help` prints every field (under the command name `prog`) and exits.
    """
    pre = _ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    from_file = read_yaml(Path(known.config)) if known.config is not None else {}
    parser = build_parser(prog, shown_defaults=from_file)
    namespace, unknown = parser.parse_known_args(rest)
    if unknown:
        raise unrecognized(unknown, prog)
    flags = {key: value for key, value in vars(namespace).items() if key != "config"}
    values, notes, saved = {**from_file, **flags}, [], None
    if values.get("resume_from_checkpoint"):  # the run's saved configuration, what the flags typed change
        saved = saved_configuration(values.get("output_dir", _default("output_dir")), values["resume_from_checkpoint"])
    if saved is not None:
        checkpoint, recorded = saved
        where = f"resume_from_checkpoint: {short(str(checkpoint / STATE_FILE))[1:-1]}: config"
        recorded = checked_values({k: v for k, v in recorded.items() if k not in LOCATION}, where)
        values, notes = resumed_values(recorded, from_file, flags, checkpoint)
    config = build_config(with_model_config(values))
    if saved is not None and (problem := different_run(checkpoint, recorded, config.to_dict())):
        raise ConfigError(problem)
    config.notes = notes
    return config


def with_model_config(values: dict[str, Any]) -> dict[str, Any]:
    """`values` over the model fields that `values["model_config"]` (a Llama or P2R config.json) gives, if any (not
    read again where `values` has every model field: a resume's saved configuration)."""
    names = {f.name for f in dataclasses.fields(ModelArguments)} - {"model_config"}
    if values.get("model_config") is None or names <= values.keys():
        return values
    source, found = read_model_config(values["model_config"], names)
    return {**checked_values(found, f"model_config: {short(source)[1:-1]}"), **values}


def _default(name: str) -> Any:
    return SECTION_OF[name].__dataclass_fields__[name].default


def build_config(values: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` of flat {field: value} (each field's default where absent), its fields checked one by one
    and then together (`hf_p2r.config.rules`)."""
    return TrainConfig.from_dict(values)


def field_types() -> dict[str, Any]:
    """{field name: its annotation} of every section: the YAML keys and flags."""
    return {name: section.__dataclass_fields__[name].type for name, section in SECTION_OF.items()}


# --- the command line -------------------------------------------------------------------------------------------------
class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse prints the whole usage and exits; we want one line from the caller.
        raise ConfigError(one_line(message))


def build_parser(prog: str, shown_defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The trainer's parser: one group of flags per section, each flag typed, with its help and the value it takes
    when not given (`shown_defaults`, e.g. the YAML file's, else the field's default). A flag not typed leaves its
    field out of the result (argparse's SUPPRESS), so values can be layered."""
    parser = _ArgumentParser(
        prog=prog,
        usage="%(prog)s [--config FILE] [--FIELD VALUE ...]",
        description=DESCRIPTION,
        allow_abbrev=False,  # --pseudo_step must not be taken for --pseudo_steps
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of FIELD: VALUE lines; flags on the command line override it.")
    shown = shown_defaults or {}
    for name, section in SECTIONS.items():
        group = parser.add_argument_group(f"{name} ({section.__name__})", " ".join(section.__doc__.split()))
        for f in dataclasses.fields(section):
            declared = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            add_flag(group, f.name, f.type, declared, shown.get(f.name, declared), f.metadata.get("help", ""))
    return parser


def add_flag(parser, name: str, annotation, declared: Any, default: Any, text: str) -> None:
    """The flag of field `name` (its `declared` default; `default` is shown), read as transformers' `HfArgumentParser`
    reads a field of that type: `Optional[X]` as X; a `Literal` as its choices; a bool as yes/no/true/false/1/0
    (alone: true; `--no_FIELD` for one declared true); a list as zero or more values (none, [] or no value: empty)."""
    options = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    shown = "" if default is None and annotation is not type(None) else f" (default: {default})"
    kwargs: dict[str, Any] = {"help": text + shown.replace("%", "%%")}
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args and bool not in args:
        annotation = next(arg for arg in args if arg is not type(None))  # Optional[X] -> X
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        by_text = {str(choice): choice for choice in choices}
        kwargs.update(choices=choices, type=lambda text: by_text.get(text, text))
    elif annotation is bool or annotation == bool | None:
        kwargs["type"] = string_to_bool
        if annotation is bool:
            kwargs.update(nargs="?", const=True)
    elif origin is list:
        empty = None if declared is None else []  # None for an optional list (pipeline_split)
        kwargs.update(nargs="*", action=_list_action(typing.get_args(annotation)[0], empty))
    elif origin is dict:
        kwargs.update(type=mapping_from_text, metavar="{KEY: VALUE, ...}")
    else:
        kwargs["type"] = annotation
    parser.add_argument(*options, **kwargs)
    if declared is True and annotation is bool:
        parser.add_argument(
            f"--no_{name}", f"--no-{name.replace('_', '-')}", action="store_false", dest=name, help=f"--{name} false"
        )


def _list_action(item_type: type, empty: list | None) -> type[argparse.Action]:
    """The action of a list flag: values converted by `item_type`; `none`, `[]` or no value give `empty`."""

    class ListAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if values in ([], ["none"], ["[]"]):
                setattr(namespace, self.dest, empty)
                return
            converted = []
            for value in values:
                try:
                    converted.append(item_type(value))
                except (TypeError, ValueError):
                    raise argparse.ArgumentError(self, f"invalid {item_type.__name__} value: {short(value)}") from None
            setattr(namespace, self.dest, converted)

    return ListAction


def mapping_from_text(text: str) -> dict | None:
    """A mapping flag's value: YAML flow text (`{rope_type: linear, factor: 2.0}`); `none` or `null`: None."""
    if text.strip() in ("none", "null", ""):
        return None
    try:
        value = yaml.safe_load(text[:10_000])
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):
        value = text
    if not isinstance(value, dict):
        example = "{rope_type: linear, factor: 2.0}"
        raise argparse.ArgumentTypeError(f"expected a mapping such as {example}, got {short(text)}")
    return value


def unrecognized(tokens: list[str], prog: str) -> ConfigError:
    """The error for command-line tokens no flag takes: the flag meant, when one is close; `--config` before a YAML
    file given alone."""
    flag = next((token for token in tokens if token.startswith("--")), "").partition("=")[0][2:].replace("-", "_")
    close = difflib.get_close_matches(flag, field_types(), n=1) if 0 < len(flag) < 100 else []
    hint = f"did you mean --{close[0]}? " if close else ""
    files = [token for token in tokens if token.endswith((".yaml", ".yml")) and not token.startswith("-")]
    yaml_file = files[0] if files and len(files[0]) < 200 else ""
    if yaml_file:
        hint = f"a configuration file is given with --config: {prog} --config {short(yaml_file)[1:-1]}; "
    shown = " ".join(token if token and token.isprintable() else repr(token) for token in tokens)
    return ConfigError(f"unrecognized arguments: {one_line(shown)} ({hint}see --help for the fields)")


# --- the YAML file ----------------------------------------------------------------------------------------------------
def read_yaml(path: Path) -> dict[str, Any]:
    """The FIELD: VALUE pairs of YAML file `path`, each converted to its field's type as the command line converts a
    value (a string "3e-4" read as a number) and checked against it; `ConfigError` naming the file for anything else:
    a path that is not a regular file (a FIFO or a device is never read, so never blocks), over `MAX_CONFIG_BYTES`,
    not UTF-8, not YAML (nested too deeply included), not a mapping, an unknown key, a value of the wrong type."""
    shown = str(path) if str(path).isprintable() else repr(str(path))
    text = _read_text(path, shown)
    try:
        values = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"config: {shown} is not valid YAML (nested too deeply)") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as error:  # PyYAML's constructors raise the latter
        raise ConfigError(f"config: {shown} is not valid YAML ({_yaml_problem(error)})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config: {shown} must hold FIELD: VALUE lines, got a {type(values).__name__}")
    return checked_values(values, f"config: {shown}")


def checked_values(values: dict, where: str) -> dict[str, Any]:
    """`values` ({key: value} read from a file) converted as the command line converts them, each key a field and
    each value of its field's type; else `ConfigError` starting with `where` and naming the key."""
    fields = field_types()
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1) if isinstance(key, str) and len(key) < 100 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {short(key)}{hint}")
    converted = {}
    for key, value in values.items():
        try:  # the field's own declared checks
            converted[key] = check_value(SECTION_OF[key], key, from_text(value, fields[key]))
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    return converted


def _read_text(path: Path, shown: str) -> str:
    try:
        # Non-blocking: opening a FIFO for reading returns at once (and is then refused) instead of waiting.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        raise ConfigError(f"config: cannot read {shown}: {error.strerror}") from None
    except ValueError:  # a NUL character in the path
        raise ConfigError(f"config: cannot read {shown}: not a valid path") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ConfigError(f"config: {shown} is not a regular file")
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(MAX_CONFIG_BYTES + 1)  # bounded, also for a file that grows
        except OSError as error:
            raise ConfigError(f"config: cannot read {shown}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {shown} is over {MAX_CONFIG_BYTES >> 20} MiB, too large for a configuration")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: {shown} is not UTF-8 text (byte {error.start})") from None


def _yaml_problem(error: Exception) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        where = f"line {error.problem_mark.line + 1}: " if error.problem_mark else ""
        context = f"{error.context}, " if error.context else ""
        return one_line(where + context + error.problem)
    return one_line(str(error)) or type(error).__name__


def from_text(value: Any, annotation) -> Any:
    """A value read from a file as the command line would give it: a string converted to the number or boolean the
    field takes (YAML reads 3e-4 as a string), null for a list field as the empty list (`--FIELD none`), false for a
    choice of "no" as "no"."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = args or (annotation,)
    if value is None and type(None) not in kinds and any(typing.get_origin(kind) is list for kind in kinds):
        return []
    if value is False and any(typing.get_origin(kind) is Literal and "no" in typing.get_args(kind) for kind in kinds):
        return "no"  # YAML 1.1 reads `mixed_precision: no` as false
    if isinstance(value, str):
        for kind, convert in ((int, int), (float, float), (bool, string_to_bool)):
            if kind in kinds:
                try:
                    return convert(value)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    pass
    return value


__all__ = ["MAX_CONFIG_BYTES", "build_config", "build_parser", "field_types", "parse_config", "read_yaml"]
