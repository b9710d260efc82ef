"""The trainer's configuration under random and mutated input (issue 23): whatever a YAML file or a command line holds,
`parse_config` returns a `TrainConfig` or raises one `ConfigError` of one line; nothing else escapes."""

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_p2r.config import SECTIONS
from hf_p2r.training import ConfigError, TrainConfig, parse_config

from .helpers import REPO

FIELDS = [name for section in SECTIONS.values() for name in section.__dataclass_fields__]
DEMO = (REPO / "configs" / "demo.yaml").read_bytes()
SYNTAX = [b"[", b"{", b"]", b"- ", b": ", b"&a ", b"*a", b"!!", b"\n  ", b"---\n", b"\t", b"\xff"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Sizes up to and far past the models' bounds (hf_p2r.models.p2r checks them before anything scales with them).
numbers = (
    st.integers(-3, 40)
    | st.sampled_from([0, 1, 2, 8, 10**4, 10**6, 10**9, 2**63, 10**30, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
)
scalars = numbers | st.booleans() | st.none() | st.text(max_size=12) | st.sampled_from(["none", "[]", "auto", "3e-4"])
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
keys = st.sampled_from(FIELDS) | st.text(max_size=16)


@pytest.fixture(scope="module")
def config_file():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder) / "config.yaml"


def _parse(argv: list[str]) -> None:
    """Parse `argv`: a `TrainConfig`, or one `ConfigError` of one line."""
    try:
        config = parse_config(argv)
    except ConfigError as error:
        message = str(error)
        assert message.isprintable() and len(message) < 1000, message  # one line, no control characters
    else:
        assert isinstance(config, TrainConfig)
        config.delink_schedule()  # the schedule the trainer reads resolves too
        config.to_dict()


@SETTINGS
@given(document=st.dictionaries(keys, values, max_size=6))
def test_random_yaml_documents_parse_or_raise_one_line(config_file, document):
    config_file.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8")
    _parse(["--config", str(config_file)])


@SETTINGS
@given(
    edits=st.lists(
        st.tuples(
            st.floats(0, 1), st.integers(0, 8), st.binary(max_size=6) | st.sampled_from([b"[", b"{", b"&a", b"*a"])
        ),
        min_size=1,
        max_size=6,
    )
)
def test_mutated_demo_configs_parse_or_raise_one_line(config_file, edits):
    """configs/demo.yaml with bytes deleted and inserted at random places (brackets, anchors, aliases among them)."""
    data = bytearray(DEMO)
    for where, delete, insert in edits:
        at = int(where * len(data))
        data[at : at + delete] = insert
    config_file.write_bytes(bytes(data))
    _parse(["--config", str(config_file)])


# A command line: flags with zero or more values each (mostly plausible ones), with stray tokens among them.
plausible = st.sampled_from(
    ["0", "1", "2", "3", "4", "8", "16", "0.5", "1e-3", "nan", "-1", "10000", "1000000000", "none", "[]", "[0]",
     "[1, 3]", "true", "false", "auto", "cycle", "sequence", "wsd", "cosine", "bf16", "no", "scale", "2bw"]
)  # fmt: skip
names = st.sampled_from(FIELDS)
exact, dashed = names.map("--{}".format), names.map(lambda name: f"--{name.replace('_', '-')}")
flags = st.one_of(*[exact] * 6, dashed, names.map(lambda name: f"--{name[:-1]}"))  # the last abbreviated: refused
arguments = st.one_of(plausible, plausible, numbers.map(str), st.text(max_size=8))
options = st.tuples(flags, st.one_of(st.tuples(arguments), st.tuples(arguments), st.lists(arguments, max_size=2))).map(
    lambda option: [option[0], *option[1]]
)
stray = st.sampled_from(["--", "-", "--config", "=", "--no_remote_code", "--pseudo_steps=5"]) | st.text(max_size=10)
parts = st.one_of(*[options] * 8, stray.map(lambda token: [token]))
command_lines = st.lists(parts, max_size=6).map(
    lambda parts: [token for part in parts for token in part if token not in ("-h", "--help")]
)


@SETTINGS
@given(argv=command_lines)
def test_random_command_lines_parse_or_raise_one_line(argv):
    _parse(argv)


@SETTINGS
@given(argv=command_lines)
def test_random_overrides_of_the_demo_parse_or_raise_one_line(argv):
    _parse(["--config", str(REPO / "configs" / "demo.yaml"), *argv])
