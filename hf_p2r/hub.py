"""Publishing checkpoint folders to the Hugging Face Hub, with a model card (`hf_p2r.checkpoint.card`, rendered from
`model_cards/`).

Everything goes through huggingface_hub: `HfApi.create_repo` and one `HfApi.create_commit` upload the folder and the
card together. (The card is added as an operation of that commit instead of being written into the folder, so pushing
never modifies the folder.)

Only what lies within the folder is uploaded (`hf_p2r.checkpoint.io.files_within`: regular files, and the links of a
Hugging Face cache snapshot into its own blobs); a link out of the folder (to /etc/passwd, say), a FIFO or a device is
skipped and said so. So is what is not a valid file of its kind (a `.safetensors` file whose header does not describe
it, a 0-byte one included; a `.json` file that is not JSON), a folder named README.md (the card is rendered instead)
and a name with unprintable characters (a newline...). The dry run's listing and the push come from one plan
(`_plan`): the listing is exactly what is uploaded. The repo id and the branch are checked before anything is read or
sent; names from disk are shown with their control characters escaped, and the token never.
"""

import dataclasses
import logging
import os
import re
from pathlib import Path

import yaml
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
from huggingface_hub.utils import HFValidationError, validate_repo_id
from tqdm import tqdm

from .checkpoint.card import render_model_card
from .checkpoint.headers import read_header, read_weights
from .checkpoint.io import CONFIG_NAME, file_within, files_within, read_config_dict, why_skipped
from .errors import InputError, printable, read_json, redact

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
# A README.md larger than this is not a card hf-p2r wrote (those are a few KB): it is uploaded as it is, unparsed.
MAX_CARD_BYTES = 1 << 20
# Skipped files named in the one line that reports them; the rest are counted.
_NAMED_SKIPS = 10


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> str:
    """Upload the checkpoint `folder` to the Hub model repository `repo_id` (created if needed) in one commit, with
    a model card; returns the commit URL, or with `dry_run` a report of what would be uploaded (no network).

    The card: a folder without README.md gets one rendered by `render_model_card`; the card `convert_pseudo_to_real`
    wrote is re-rendered with `repo_id` (its provenance kept) as long as it is unedited; any other README.md is
    uploaded as it is. Hidden files and folders are not uploaded, nor anything that is not a file within `folder`
    (`files_within`: a link out of it, a FIFO, a device, a link to a folder); those are named in the dry run's report,
    or in one warning (logger `hf_p2r.hub`) before a real push. A Hugging Face cache snapshot's links into its blobs
    are files within it. `private` only applies to a repository this call creates; `revision` is a branch, created if
    needed. `repo_id` (huggingface_hub's `validate_repo_id`) and `revision` (a branch name git and the Hub accept) are
    checked first, in a dry run too: `InputError` naming the argument. `token` defaults to huggingface_hub's (HF_TOKEN
    or `hf auth login`) and is never printed.

    ```python
    >>> print(push_to_hub("real_24", "me/p2r-24", dry_run=True))   # files + card, nothing sent
    >>> push_to_hub("real_24", "me/p2r-24", private=True)
    ```
    """
    check_repo_id(repo_id)
    check_branch(revision)
    folder = Path(folder)
    plan = _plan(folder, repo_id)
    files, skipped, card = plan.files, plan.skipped, plan.card
    commit_message = commit_message or f"Upload {folder.name} with hf-p2r"
    if dry_run:
        return redact(_report(folder, repo_id, plan, private=private, revision=revision))
    if skipped:
        logger.warning(_skipped_line(folder, skipped))

    api = HfApi(token=token)
    # private=None (not False) when not asked: the organization's default visibility then applies.
    api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    # The resolved paths: a file swapped for a link after the listing is not followed out of the folder.
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=target) for path, target in files.items()]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=redact(str(card)).encode()))
    commit = api.create_commit(
        repo_id, operations=operations, commit_message=commit_message, revision=revision, repo_type="model"
    )
    return commit.commit_url


def check_repo_id(repo_id: str) -> None:
    """`InputError` unless `repo_id` is a Hub repository id ("name" or "namespace/name": huggingface_hub's
    `validate_repo_id`)."""
    try:
        validate_repo_id(repo_id)
        if not repo_id:
            raise HFValidationError("it is empty")
    except HFValidationError as error:
        raise InputError(f"repo_id {_cut(repr(repo_id))} is not a Hub repository id: {_cut(str(error), 300)}") from None


# What git refuses in a branch name (`git check-ref-format --branch`), which is what the Hub accepts as one.
_BAD_IN_BRANCH = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def check_branch(revision: str | None) -> None:
    """`InputError` unless `revision` is None or a branch name git accepts (`git check-ref-format --branch`), in
    UTF-8: no space, control character or any of ``~^:?*[\\``, no ``..``, ``@{`` or ``//``, no part starting with
    ``.`` or ending with ``.lock``, not starting with ``-`` or ``/``, not ending with ``/`` or ``.``, not ``@`` or
    ``HEAD``."""
    if revision is None:
        return
    problem = None
    if not isinstance(revision, str) or not revision:
        problem = "it must be a non-empty string"
    elif not revision.isascii() and not _is_utf8(revision):  # bytes of another encoding, from the command line
        problem = "it is not valid UTF-8"
    elif match := _BAD_IN_BRANCH.search(revision):
        problem = f"it contains {match[0]!r}"
    elif revision.startswith(("-", "/")) or revision.endswith(("/", ".")) or revision in ("@", "HEAD"):
        problem = "it must not start with '-' or '/', end with '/' or '.', or be '@' or 'HEAD'"
    elif any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        problem = "no part of it may start with '.' or end with '.lock'"
    if problem:
        raise InputError(f"revision {_cut(repr(revision))} is not a branch name git and the Hub accept: {problem}")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _cut(text: str, limit: int = 120) -> str:
    """`text`, cut to `limit` characters (a message quotes a value, not megabytes of it)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _card_for_upload(folder: Path, repo_id: str) -> tuple[ModelCard | None, str]:
    """(card to upload, why) — None means the folder's own README.md goes up unchanged."""
    readme = folder / CARD_NAME
    if not os.path.lexists(readme):
        return render_model_card(folder, model_id=repo_id), "rendered from model_cards/"
    if file_within(folder, readme) is None:  # a link out of the folder, a FIFO...: never read, never uploaded
        card = render_model_card(folder, model_id=repo_id)
        return card, f"rendered from model_cards/: the folder's {CARD_NAME} is not a file within it"
    with open(readme, "rb") as file:
        data = file.read(MAX_CARD_BYTES + 1)
    try:
        existing = data.decode("utf-8") if len(data) <= MAX_CARD_BYTES else None
    except UnicodeDecodeError:
        existing = None  # not hf-p2r's card: the author's, as it is
    if existing is not None:
        try:
            provenance = ModelCard(existing).data.to_dict().get("hf_p2r")
        except (ValueError, TypeError, KeyError, yaml.YAMLError, RecursionError) as error:
            message = " ".join(str(error).split())
            raise InputError(
                f"{readme}: its metadata block (between the --- lines) is not a YAML mapping the Hub accepts "
                f"({_cut(message, 300)})"
            ) from None
        if isinstance(provenance, dict):
            # The id it was rendered for (cards written before `rendered_for` existed: the folder's name then).
            rendered_for = provenance.get("rendered_for") or folder.name
            rendered_for = rendered_for if isinstance(rendered_for, str) else folder.name
            if existing == str(render_model_card(folder, model_id=rendered_for, provenance=provenance)):
                card = render_model_card(folder, model_id=repo_id, provenance=provenance)
                return card, "the card hf-p2r convert wrote, re-rendered for this repo"
    # Not written by hf-p2r, or edited since: it is the author's card. The weights are still checked.
    read_weights(folder)
    return None, f"the folder's own {CARD_NAME}, unchanged"


@dataclasses.dataclass
class _Plan:
    """What a push uploads: `files` {path in the repo: the file}, and the model `card` (None: the folder's own
    README.md, in `files`); `skipped` {path: why} what it does not, and why."""

    files: dict[str, Path]
    card: ModelCard | None
    card_note: str
    skipped: dict[str, str]


def _plan(folder: Path, repo_id: str) -> _Plan:
    """The one plan of a push and of its dry run. Refused (`InputError`): a folder without a valid config.json or
    whose weights are damaged; skipped, with the reason: what `_why_not_uploaded` names."""
    card_folder = (folder / CARD_NAME).is_dir() and not (folder / CARD_NAME).is_symlink()
    if card_folder:
        card, card_note = render_model_card(folder, model_id=repo_id), f"rendered from model_cards/: {_CARD_FOLDER}"
    else:
        card, card_note = _card_for_upload(folder, repo_id)
    read_config_dict(folder)  # (the rendered card read it already; the author's card did not)
    kept, outside = files_within(folder)
    files, skipped = {}, dict.fromkeys(outside, _NOT_WITHIN)
    if card_folder:
        skipped[f"{CARD_NAME}/"] = _CARD_FOLDER
    for path in kept:
        if path == CARD_NAME and card is not None:
            continue
        why = _why_not_uploaded(folder, path)
        target = file_within(folder, folder / path) if why is None else None
        if why is None and target is None:  # changed since it was listed
            why = why_skipped(folder, folder / path)
        if why is None:
            files[path] = target
        elif why == _CARD_FOLDER:
            skipped[f"{CARD_NAME}/"] = why  # named once, for all it holds
        else:
            skipped[path] = why
    return _Plan(files, card, card_note, dict(sorted(skipped.items())))


_NOT_WITHIN = "not a file within the folder"
_CARD_FOLDER = f"a folder named {CARD_NAME} (the model card is a file: one is rendered instead)"


def _why_not_uploaded(folder: Path, path: str) -> str | None:
    """Why the file at `path` (within `folder`) is not uploaded, or None: a name with characters that are not printable
    (control characters, a newline: `str.isprintable`); a file under a folder named README.md; a `.safetensors` file
    whose header does not describe it (a 0-byte one included), a `.json` file that is not JSON."""
    if not path.isprintable():
        return "its name has unprintable characters"
    if path.startswith(f"{CARD_NAME}/"):
        return _CARD_FOLDER
    try:
        if path.endswith(".safetensors"):
            read_header(folder / path)
        elif path.endswith(".json") and path != CONFIG_NAME:  # (config.json: read by `_plan`, refused if bad)
            read_json(folder / path, expect=None)
    except (InputError, OSError) as error:
        problem = str(error).removeprefix(str(folder / path)).removeprefix(": ")
        return printable(problem, 160)
    return None


def _skipped_line(folder: Path, skipped: dict[str, str]) -> str:
    """One line naming what a push skips (the first `_NAMED_SKIPS`; the rest counted): the entries that are not files
    within the folder (links out of it, FIFOs, devices, links to folders), then the others, each with its reason."""
    outside = [path for path, why in skipped.items() if why == _NOT_WITHIN]
    others = [(path, why) for path, why in skipped.items() if why != _NOT_WITHIN]
    names = [printable(path) for path in outside] + [f"{printable(path)} ({why})" for path, why in others]
    shown = names[:_NAMED_SKIPS]
    more = f" and {len(names) - _NAMED_SKIPS} more" if len(names) > _NAMED_SKIPS else ""
    parts = []
    if outside:
        count = min(len(outside), _NAMED_SKIPS)
        parts.append(
            "not files within it (links out of it, FIFOs, devices, links to folders): " + ", ".join(shown[:count])
        )
        shown = shown[count:]
    if shown:
        parts.append("not valid files of their kind, or not uploadable: " + ", ".join(shown))
    return f"skipped {len(skipped)} of {printable(folder)}'s entries, " + "; ".join(parts) + more


def _report(folder: Path, repo_id: str, plan: _Plan, *, private: bool, revision: str | None) -> str:
    visibility = "private " if private else ""
    lines = [
        f"Dry run: would create (if needed) the {visibility}model repo {repo_id} and commit to {revision or 'main'}:"
    ]
    for path, target in plan.files.items():
        lines.append(f"  {printable(path)}  ({tqdm.format_sizeof(target.stat().st_size, 'B')})")
    if plan.card is not None:
        lines.append(f"  {CARD_NAME}  ({plan.card_note}, below)")
    else:
        lines.append(f"  (model card: {plan.card_note})")
    if plan.skipped:
        lines.append(f"Not uploaded: {_skipped_line(folder, plan.skipped)}")
    if plan.card is not None:
        lines += ["", str(plan.card)]
    return "\n".join(lines)
