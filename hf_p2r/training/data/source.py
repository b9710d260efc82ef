"""What a run's data position refers to (`data_source`), how it changed since a checkpoint (`check_data_change`), and
the output folder kept outside the data."""

import hashlib
import os
from pathlib import Path

from datasets import Dataset

from ...config import DataArguments
from ...errors import InputError
from .documents import expand_files, file_stamp, load_documents


def made_of(args: DataArguments, documents: Dataset):
    """What names a map-style dataset's content: its cache files and their sizes, or its text's digest."""
    if documents.cache_files:
        return [(f["filename"], os.stat(f["filename"]).st_size) for f in documents.cache_files]
    return hashlib.sha256("\0".join(documents[args.text_column]).encode()).hexdigest()


def data_source(args: DataArguments, documents: Dataset | None = None) -> dict:
    """What a run's data position refers to: `train_files` (each file's path, size in bytes and modification time in
    ns), the Hub dataset's name and configuration, or the built-in corpus's digest (from its `documents`)."""
    if args.dataset_name:
        return {"dataset_name": args.dataset_name, "dataset_config_name": args.dataset_config_name}
    if args.train_files:
        return {"train_files": [file_stamp(path) for path in expand_files(args.train_files)]}
    documents = documents if documents is not None else load_documents(args)
    return {"corpus": made_of(args, documents)}


def data_changes(saved: dict, now: dict) -> str | None:
    """How the data `now` (`data_source`) differs from the `saved` one, in words; None when they are the same."""
    if saved == now:
        return None
    if set(saved) != set(now) or "train_files" not in now:
        return f"{_brief(saved)} then, {_brief(now)} now"
    before, after = ({name: (size, mtime) for name, size, mtime in record["train_files"]} for record in (saved, now))
    changes = [f"{_printable(name)} is gone" for name in before if name not in after]
    changes += [f"{_printable(name)} is new" for name in after if name not in before]
    for name in (name for name in before if name in after):
        (size, mtime), (new_size, new_mtime) = before[name], after[name]
        if size != new_size:
            changes.append(f"{_printable(name)}: {size:,} bytes then, {new_size:,} now")
        elif mtime != new_mtime:
            changes.append(f"{_printable(name)}: modified (same size)")
    if not changes:
        return "the order of train_files"
    return "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")


def _brief(source: dict) -> str:
    if "train_files" in source:
        return f"train_files ({len(source['train_files'])} files)"
    if "dataset_name" in source:
        return f"dataset_name {source['dataset_name']}"
    return "the built-in corpus" + (f" (digest {str(source['corpus'])[:12]})" if "corpus" in source else "")


def _printable(text: str) -> str:
    """`text` with its control characters escaped (a file name with a line break prints on one line)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def check_data_change(saved: dict | None, now: dict, checkpoint: Path, allow: bool) -> str | None:
    """Refuse (`InputError`) a resume from `checkpoint` whose data (`saved`, `data_source`) differs from this run's
    (`now`); with `allow` (`allow_data_change`), the one-line warning to show instead. None when they agree, or when
    the checkpoint recorded no data (saved by an earlier hf-p2r)."""
    changes = None if saved is None else data_changes(saved, now)
    if changes is None:
        return None
    if allow:
        return f"warning: the training data changed since {checkpoint} was saved ({changes}); resuming on it anyway"
    raise InputError(
        f"resume_from_checkpoint: the training data changed since {checkpoint} was saved ({changes}): the data "
        "position it holds would point into other data; restore the data, or pass --allow_data_change to resume on it"
    )


def check_output_dir_outside_data(args: DataArguments, output_dir: str | Path) -> None:
    """Refuse an `output_dir` inside a folder of `train_files` or `validation_files`: the next run would read the
    run's own files (metrics.jsonl, README.md...) as data."""
    output = Path(output_dir).resolve()
    for field in ("train_files", "validation_files"):
        for name in getattr(args, field):
            folder = Path(name)
            if folder.is_dir() and output.is_relative_to(folder.resolve()):
                raise InputError(
                    f"output_dir: {_printable(str(output_dir))} is inside {_printable(name)}, a folder of {field}: "
                    "the next run would read this run's files as data; write the run elsewhere"
                )
