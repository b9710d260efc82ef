"""What an output folder holds and may replace: the files that travel with a checkpoint (tokenizer, generation settings,
chat templates, model code) and the guard every command that writes a folder passes first (`check_output_folder`:
never its own input, never a training run or files of yours). Plain Python."""

import fnmatch
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..errors import InputError, printable
from .io import CONFIG_NAME, files_within, resolve_destination, why_skipped

logger = logging.getLogger(__name__)

# Files other than weights and config.json that travel with a checkpoint (tokenizer and generation settings).
CARRIED_FILES = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
)
# Folders that travel with it: transformers' named chat templates (additional_chat_templates/<name>.jinja).
CARRIED_FOLDERS = ("additional_chat_templates",)
# The rest of a model folder hf-p2r writes (`check_output_folder`: what --overwrite may replace): config, card,
# weights (one file, or shards and their index), model code.
MODEL_FOLDER_FILES = (CONFIG_NAME, "README.md", "model*.safetensors", "model.safetensors.index.json", "*.py")
# What shows a folder holds a training run (`hf_p2r.training`: output_dir, a checkpoint folder): never replaced.
TRAINING_RUN_FILES = ("checkpoints", "trainer_state.json", ".metadata", "metrics.jsonl", "train_config.yaml")


def carry_files(src: Path, dst: Path, *, remote_code: bool) -> None:
    """Copy the files that travel with a checkpoint (`CARRIED_FILES`, `CARRIED_FOLDERS`, and the model code when
    `remote_code`) that lie within `src` (`files_within`); warn about those skipped (a link out of `src`, a FIFO...)."""
    patterns = CARRIED_FILES + (("*.py",) if remote_code else ())

    def carried(relative: str) -> bool:
        folder, _, name = relative.partition("/")
        if name:
            return folder in CARRIED_FOLDERS
        return relative in CARRIED_FOLDERS or (
            relative != CONFIG_NAME and any(fnmatch.fnmatchcase(relative, pattern) for pattern in patterns)
        )

    kept, skipped = files_within(src)
    for relative in filter(carried, kept):
        (dst / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / relative, dst / relative)
    for relative in filter(carried, skipped):
        logger.warning(f"skipped {printable(relative)}: {why_skipped(src, src / relative)}")


def check_output_folder(dst: str | os.PathLike, sources: Iterable[str | os.PathLike], *, overwrite: bool) -> Path:
    """Where output folder `dst` is written (`resolve_destination`), after checking that writing it there loses
    nothing; for every command that writes a folder from folders it reads (`convert`, `export`). Refused:

    - `dst` equal to one of `sources` (the folders read: a checkpoint, its run), inside one or containing one
      (`InputError`): the output would replace its own input;
    - a non-empty `dst` without `overwrite` (`FileExistsError`);
    - with `overwrite`, a `dst` that is not an earlier output (`InputError`): a training run (its `checkpoints/`,
      `trainer_state.json`, DCP shards, `metrics.jsonl`), or a folder holding anything a model folder of hf-p2r does
      not (`MODEL_FOLDER_FILES`, `CARRIED_FILES`, `CARRIED_FOLDERS`: your own files are never replaced).
    """
    destination = resolve_destination(dst).resolve()
    for source in sources:
        source = Path(os.path.realpath(source))
        if destination == source or destination.is_relative_to(source) or source.is_relative_to(destination):
            raise InputError(
                f"{printable(dst)}: the output must not be the source {printable(source)}, inside it, or contain it"
            )
    if not destination.is_dir() or not any(destination.iterdir()):
        return destination
    if not overwrite:
        raise FileExistsError(
            f"{printable(destination)}: folder is not empty (overwrite=True, or --overwrite, replaces it)"
        )
    entries = sorted(destination.iterdir())
    if run := [entry.name for entry in entries if entry.name in TRAINING_RUN_FILES]:
        raise InputError(
            f"{printable(dst)}: holds a training run ({', '.join(run)}); --overwrite replaces only an earlier output "
            "of this command, never a run: choose another output folder"
        )
    if foreign := [entry.name for entry in entries if not _model_folder_entry(entry)]:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise InputError(
            f"{printable(dst)}: holds {', '.join(printable(name, 80) for name in foreign[:3])}{more}, which no model "
            "folder of hf-p2r holds; --overwrite replaces only an earlier output of this command (a model folder): "
            "choose another output folder, or empty this one"
        )
    return destination


def _model_folder_entry(entry: Path) -> bool:
    """Whether `entry` (of a folder) is what a model folder of hf-p2r holds: its files, or a carried folder."""
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return entry.name in CARRIED_FOLDERS
    patterns = MODEL_FOLDER_FILES + CARRIED_FILES
    return entry.is_file() and any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in patterns)
