"""What a resume reads of the run it continues, before anything else: the configuration its checkpoint recorded.

A resume (`resume_from_checkpoint`) takes that configuration as it was: the flags typed now change it, field by field,
and the run says which in one line (`notes`). Where to find the checkpoint (`output_dir`, `resume_from_checkpoint`,
`overwrite_output_dir`) is always this invocation's; a YAML file given again does not change the saved values (the run
says which of its values it left). The fields a checkpoint's weights and optimizer groups depend on (`FIXED`) cannot
change: that is one line naming them. Extending the run (more `real_steps`) keeps the learning-rate schedule's end
where it was (`lr_schedule_steps`), unless a flag says otherwise.

Plain Python: the checkpoint's `trainer_state.json` is read here, before torch is imported; everything else in the
checkpoint is checked and loaded by the trainer (`hf_p2r.training.checkpointing.read_state`).
"""

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import InputError, printable, read_json
from .fields import short
from .sections import SECTION_OF

# Where a run's checkpoints are (`output_dir/checkpoints/checkpoint-N/`) and the file each records its state and
# configuration in (`hf_p2r.training.checkpointing` writes them).
CHECKPOINTS, STATE_FILE = "checkpoints", "trainer_state.json"
# Where the run is: this invocation's, whatever the checkpoint recorded.
LOCATION = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")
# What a checkpoint's weights, data position and optimizer groups depend on: a resume keeps them (the fields declared
# with `resume="fixed"`).
FIXED = tuple(name for name, kind in SECTION_OF.items() if kind.__dataclass_fields__[name].metadata["resume"] != "free")


def field_defaults() -> dict[str, Any]:
    """{field: its default} of every field."""
    defaults = {}
    for name, kind in SECTION_OF.items():
        f = kind.__dataclass_fields__[name]
        defaults[name] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return defaults


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest `checkpoint-N` folder with a state file under `output_dir/checkpoints`, None if there is none."""
    found = [
        (int(path.name.removeprefix("checkpoint-")), path)
        for path in (Path(output_dir) / CHECKPOINTS).glob("checkpoint-*")
        if path.name.removeprefix("checkpoint-").isdigit() and (path / STATE_FILE).is_file()
    ]
    return max(found)[1] if found else None


def saved_configuration(output_dir: str | Path, name: str) -> tuple[Path, dict] | None:
    """(checkpoint, the flat configuration it recorded) of `resume_from_checkpoint` `name` ("latest" or a folder),
    or None where there is no readable one (the trainer then names the problem: `resolve_checkpoint`,
    `read_trainer_state`)."""
    checkpoint = latest_checkpoint(output_dir) if name == "latest" else Path(name)
    if checkpoint is None or not (checkpoint / STATE_FILE).is_file():
        return None
    try:
        saved = read_json(checkpoint / STATE_FILE).get("config")
    except (OSError, InputError):
        return None
    return (checkpoint, saved) if isinstance(saved, dict) else None


def differing(saved: dict, current: dict) -> list[str]:
    """The `FIXED` fields whose value `current` changes from the `saved` configuration ({field: value}; a field the
    saved one lacks, from an older hf-p2r, had its default)."""
    defaults = field_defaults()
    return [name for name in FIXED if saved.get(name, defaults[name]) != current.get(name, defaults[name])]


def different_run(checkpoint: Path, saved: dict, current: dict) -> str | None:
    """The one line refusing a resume of `checkpoint` whose fixed fields `current` changes; None if none."""
    names = differing(saved, current)
    if not names:
        return None
    defaults = field_defaults()
    then = {name: saved.get(name, defaults[name]) for name in names}
    details = ", ".join(
        f"{name}={printable(repr(then[name]), 80)} there, {printable(repr(current.get(name, defaults[name])), 80)} now"
        for name in names
    )
    hint = (
        f"; an optimizer's state does not load into another's: resume with --optimizer "
        f"{printable(then['optimizer'], 20)}, or start a new run"
        if "optimizer" in names
        else ""
    )
    return f"resume_from_checkpoint: {checkpoint} comes from a different run ({details}){hint}"


def resumed_values(saved: dict, from_file: dict, flags: dict, checkpoint: Path) -> tuple[dict[str, Any], list[str]]:
    """The values of a resume, and the lines that say what changed: the `saved` configuration, over it the location
    fields given now (`from_file`, `flags`), then the other `flags`; a YAML value that differs from the saved one is
    not applied (said). A longer or shorter run keeps the saved schedule's length (`lr_schedule_steps`) unless
    `flags` give one."""
    defaults = field_defaults()
    saved = {key: value for key, value in saved.items() if key not in LOCATION}
    location = {key: value for key, value in from_file.items() if key in LOCATION}
    values = {**saved, **location, **flags}
    notes = []
    changed = [key for key in flags if key not in LOCATION and flags[key] != saved.get(key, defaults.get(key))]
    if changed:
        shown = ", ".join(f"{key} {short(saved.get(key, defaults[key]))} -> {short(flags[key])}" for key in changed)
        notes.append(f"resume: the configuration saved in {checkpoint}, with {shown} (given now)")
    else:
        notes.append(f"resume: the configuration saved in {checkpoint}")
    left = [
        key
        for key, value in from_file.items()
        if key not in LOCATION and key not in flags and value != saved.get(key, defaults.get(key))
    ]
    if left:
        notes.append(
            f"resume: the config file's {', '.join(left)} not applied (the saved run's are kept; a flag changes one)"
        )
    total, now = _steps(saved, defaults), _steps(values, defaults)
    if now != total and "lr_schedule_steps" not in flags and saved.get("lr_schedule_steps") is None:
        values["lr_schedule_steps"] = total
        after = f"steps {total}-{now - 1} at its final rate" if now > total else f"the run ends at step {now}"
        notes.append(
            f"resume: the learning-rate schedule keeps its end at step {total} (lr_schedule_steps {total}; {after}); "
            f"--lr_schedule_steps {now} fits it to the new length instead"
        )
    return values, notes


def _steps(values: dict, defaults: dict) -> int:
    return values.get("pseudo_steps", defaults["pseudo_steps"]) + values.get("real_steps", defaults["real_steps"])


__all__ = [
    "CHECKPOINTS",
    "FIXED",
    "LOCATION",
    "STATE_FILE",
    "different_run",
    "differing",
    "field_defaults",
    "latest_checkpoint",
    "resumed_values",
    "saved_configuration",
]
