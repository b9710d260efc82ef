"""Which files of hf_p2r a trainer field enters, followed through the calls it is passed to (issue 38, point 3's count).

    python scripts/field_reach.py optimizer_carry offload      # one line per field; --files lists them

A tiny one-process CPU run (pseudo stage, a partial delink, the delink, real stage, a checkpoint) and its resume are
traced (`sys.setprofile`): a call of a function of hf_p2r "carries" the field when one of its arguments holds it, that
is, the object is, or holds within two attributes, an object of hf_p2r whose class declares the field (a section, a
configuration, an engine holding one). Counted: the files of those functions, and the functions.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = str(REPO / "hf_p2r") + os.sep
RUN = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_unique_layers=1,
    block_size=32, corpus_max_bytes=30000, per_device_batch_size=4, learning_rate=3e-3, warmup_steps=2,
    logging_steps=1, eval_steps=2, eval_blocks=8, cpu="true", pseudo_steps=2, partial_delink_blocks=2, save_steps=2,
)  # fmt: skip


def holds(obj, field: str, depth: int = 0, deepest: int = 2) -> bool:
    """Whether `obj` declares `field` or holds, within `deepest` attributes, an object of hf_p2r that does."""
    kind = type(obj)
    if not (kind.__module__ or "").startswith("hf_p2r") or isinstance(obj, type):
        return False
    if field in getattr(kind, "__dataclass_fields__", {}) or field in vars(kind):
        return True
    if kind.__name__ == "TrainArguments":  # the flat view: its sections' fields
        return any(holds(part, field, depth, deepest) for part in obj.__dict__["_sections"].values())
    if depth >= deepest:
        return False
    try:
        values = list(vars(obj).values())
    except TypeError:
        return False
    return any(holds(value, field, depth + 1, deepest) for value in values)


def trace(fields: list[str], deepest: int = 2) -> dict[str, dict[str, set[str]]]:
    """{field: {file: functions}} over a traced run and its resume (an argument holding the field within `deepest`
    attributes)."""
    from hf_p2r.training import parse_config, train

    entered = {field: {} for field in fields}

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(PACKAGE):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        local = frame.f_locals
        for field in fields:
            if any(name in local and holds(local[name], field, deepest=deepest) for name in names):
                path = str(Path(code.co_filename).relative_to(REPO))
                entered[field].setdefault(path, set()).add(code.co_name)

    with tempfile.TemporaryDirectory() as folder:
        argv = [
            token for key, value in {**RUN, "output_dir": f"{folder}/run"}.items() for token in (f"--{key}", str(value))
        ]
        for extra in ([], ["--real_steps", "3", "--resume_from_checkpoint", "latest"]):
            config = parse_config(argv + ["--real_steps", "2"] + extra)
            sys.setprofile(profile)
            try:
                assert train(config) == 0
            finally:
                sys.setprofile(None)
    return entered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fields", nargs="+")
    parser.add_argument("--files", action="store_true", help="list the files and functions")
    parser.add_argument(
        "--depth",
        type=int,
        default=2,
        help="attributes followed from an argument: 0, the object declaring the field; 1, also a configuration "
        "holding its section; 2 (default), also an object holding a configuration (an engine)",
    )
    args = parser.parse_args(argv)
    for field, files in trace(args.fields, args.depth).items():
        print(f"{field}: {len(files)} files, {sum(map(len, files.values()))} functions")
        if args.files:
            for path, functions in sorted(files.items()):
                print(f"  {path}: {', '.join(sorted(functions))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
