"""Publishing checkpoint folders to the Hugging Face Hub, with a model card rendered from `model_cards/`.

Everything goes through huggingface_hub: `ModelCard`/`ModelCardData` render the card, `HfApi.create_repo` and one
`HfApi.create_commit` upload the folder and the card together. (The card is added as an operation of that commit
instead of being written into the folder, so pushing never modifies the folder.)
"""

import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from tqdm import tqdm

from .checkpoint.headers import read_weights
from .checkpoint.io import read_config_dict

# hf_p2r/model_cards links to model_cards/ at the top of the repository; a wheel holds a copy.
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent / "model_cards" / "model_card.md"
CARD_NAME = "README.md"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# config.json fields shown in the card's table
_CONFIG_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def render_model_card(
    folder: str | os.PathLike, *, model_id: str | None = None, provenance: dict | None = None
) -> ModelCard:
    """The model card of the checkpoint in `folder`, rendered from `model_cards/model_card.md`.

    `model_id` (a Hub repo id, or a name; default: the folder's name) appears in the title and the code snippet.
    `provenance` (written by `convert_pseudo_to_real`) is stored in the card's metadata under `hf_p2r`, with
    `rendered_for: model_id` (so that `push_to_hub` can tell an unedited card, and render it again for the repo, even
    after the folder was renamed), and shown as a section. Metadata: `library_name: transformers`, `pipeline_tag:
    text-generation`, tags `pseudo-to-real`, the model type, and `custom_code` only when the folder needs
    `trust_remote_code` (its config.json has `auto_map`). The weights are opened (headers only: no tensor data is
    read) to count parameters, so a corrupt checkpoint is an error here.
    """
    folder = Path(folder)
    model_id = model_id or folder.name
    if provenance is not None:
        provenance = {**provenance, "rendered_for": model_id}
    config = read_config_dict(folder)
    model_type = config.get("model_type", "unknown")
    remote_code = "auto_map" in config
    depth = config.get("num_hidden_layers")
    share = bool(config.get("share_layers"))
    blocks = config.get("num_unique_layers") if share else depth
    weights = read_weights(folder).values()
    num_parameters = sum(info.numel for info in weights)
    dtypes = sorted({info.dtype_name for info in weights})

    moe = model_type in ("p2r_moe", "mixtral")
    if model_type in ("p2r", "p2r_moe"):
        shape = "a Mixtral-shaped mixture-of-experts decoder" if moe else "a Llama-shaped decoder"
        summary = (
            f"A *pseudo* P2R model: {shape} whose {depth} layers share {blocks} block(s) of parameters (experts and "
            "routers included)."
            if share and moe
            else f"A *pseudo* P2R model: {shape} whose {depth} layers share {blocks} block(s) of parameters."
            if share
            else f"A *real* P2R model: {shape} in which every layer has its own parameters."
        )
        blocks_text = (
            f"{blocks} (pseudo: shared, `sharing_pattern: {config.get('sharing_pattern')}`)"
            if share
            else f"{blocks} (real: one per layer)"
        )
    else:
        summary = f"A `{model_type}` checkpoint; it loads in transformers without hf-p2r."
        blocks_text = f"{depth} (one per layer)"

    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["pseudo-to-real", model_type] + (["custom_code"] if remote_code else []),
        hf_p2r=provenance,
    )
    return ModelCard.from_template(
        card_data,
        template_path=MODEL_CARD_TEMPLATE,
        model_id=model_id,
        summary=summary,
        architecture=(config.get("architectures") or ["?"])[0],
        model_type=model_type,
        blocks=blocks_text,
        share_layers=share,
        num_parameters=f"{num_parameters:,}",
        dtypes=", ".join(dtypes),
        usage=_usage(
            model_id, model_type, remote_code, has_tokenizer=any((folder / f).exists() for f in _TOKENIZER_FILES)
        ),
        weight_names="Mixtral's" if moe else "Llama's",
        experts=(
            f"{config.get('num_experts') or config.get('num_local_experts')} x FFN "
            f"{config.get('moe_intermediate_size') or config.get('intermediate_size')}, "
            f"top-{config.get('num_experts_per_tok')} per token"
            if moe
            else None
        ),
        **{key: config.get(key) for key in _CONFIG_FIELDS},
    )


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
    uploaded as it is. Hidden files and folders are not uploaded. `private` only applies to a repository this call
    creates; `revision` is a branch, created if needed. `token` defaults to huggingface_hub's (HF_TOKEN or
    `hf auth login`) and is never printed.

    ```python
    >>> print(push_to_hub("real_24", "me/p2r-24", dry_run=True))   # files + card, nothing sent
    >>> push_to_hub("real_24", "me/p2r-24", private=True)
    ```
    """
    folder = Path(folder)
    card, card_note = _card_for_upload(folder, repo_id)
    files = _files_to_upload(folder, include_readme=card is None)
    commit_message = commit_message or f"Upload {folder.name} with hf-p2r"
    if dry_run:
        return _report(folder, repo_id, files, card, card_note, private=private, revision=revision)

    api = HfApi(token=token)
    # private=None (not False) when not asked: the organization's default visibility then applies.
    api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=folder / path) for path in files]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=str(card).encode()))
    commit = api.create_commit(
        repo_id, operations=operations, commit_message=commit_message, revision=revision, repo_type="model"
    )
    return commit.commit_url


def _card_for_upload(folder: Path, repo_id: str) -> tuple[ModelCard | None, str]:
    """(card to upload, why) — None means the folder's own README.md goes up unchanged."""
    readme = folder / CARD_NAME
    if not readme.is_file():
        return render_model_card(folder, model_id=repo_id), "rendered from model_cards/"
    existing = readme.read_text(encoding="utf-8")
    provenance = ModelCard(existing).data.to_dict().get("hf_p2r")
    if isinstance(provenance, dict):
        # The id it was rendered for (cards written before `rendered_for` existed: the folder's name then).
        rendered_for = provenance.get("rendered_for") or folder.name
        if existing == str(render_model_card(folder, model_id=rendered_for, provenance=provenance)):
            card = render_model_card(folder, model_id=repo_id, provenance=provenance)
            return card, "the card hf-p2r convert wrote, re-rendered for this repo"
    # Not written by hf-p2r, or edited since: it is the author's card. The weights are still checked.
    read_weights(folder)
    return None, "the folder's own README.md, unchanged"


def _files_to_upload(folder: Path, *, include_readme: bool) -> list[str]:
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            continue
        if relative.as_posix() == CARD_NAME and not include_readme:
            continue
        files.append(relative.as_posix())
    return files


def _report(folder, repo_id, files, card, card_note, *, private, revision) -> str:
    visibility = "private " if private else ""
    lines = [
        f"Dry run: would create (if needed) the {visibility}model repo {repo_id} and commit to {revision or 'main'}:"
    ]
    for path in files:
        lines.append(f"  {path}  ({tqdm.format_sizeof((folder / path).stat().st_size, 'B')})")
    if card is not None:
        lines.append(f"  {CARD_NAME}  ({card_note}, below)")
        lines += ["", str(card)]
    else:
        lines.append(f"  (model card: {card_note})")
    return "\n".join(lines)


def _usage(model_id: str, model_type: str, remote_code: bool, *, has_tokenizer: bool) -> str:
    lines = []
    if model_type in ("p2r", "p2r_moe") and not remote_code:
        lines.append("import hf_p2r  # registers the P2R architecture with transformers")
    lines.append(f"from transformers import AutoModelForCausalLM{', AutoTokenizer' if has_tokenizer else ''}")
    lines.append("")
    extra = ", trust_remote_code=True" if remote_code else ""
    lines.append(f'model = AutoModelForCausalLM.from_pretrained("{model_id}"{extra})')
    if has_tokenizer:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")')
    return "\n".join(lines)
