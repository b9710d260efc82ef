"""The model card of a checkpoint folder, rendered from `model_cards/model_card.md` with huggingface_hub's
`ModelCard`: written by the converter beside what it converts, and by `hf_p2r.hub.push_to_hub` for a folder without
one. What a model type is (a P2R model, which needs hf-p2r, or a vanilla one; dense or with experts) comes from the
conversion targets' registry (`targets.py`).
"""

import json
import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..models.p2r.inventory_p2r import MOE_MODEL_TYPE
from .headers import read_weights
from .io import file_within, read_config_dict
from .targets import written_by

# hf_p2r/model_cards links to model_cards/ at the top of the repository; a wheel holds a copy.
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_cards" / "model_card.md"
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
    model_type = config.get("model_type")
    model_type = model_type if isinstance(model_type, str) else "unknown"
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else "?"
    remote_code = "auto_map" in config
    depth = config.get("num_hidden_layers")
    share = bool(config.get("share_layers"))
    blocks = config.get("num_unique_layers") if share else depth
    weights = read_weights(folder).values()
    num_parameters = sum(info.numel for info in weights)
    dtypes = sorted({info.dtype_name for info in weights})

    writer = written_by(model_type)  # the conversion target that writes such checkpoints, and from which model
    moe = writer is not None and writer[1] == MOE_MODEL_TYPE
    p2r = writer is not None and not writer[0].vanilla
    if p2r:
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
        architecture=architecture,
        model_type=model_type,
        blocks=blocks_text,
        share_layers=share,
        num_parameters=f"{num_parameters:,}",
        dtypes=", ".join(dtypes),
        usage=usage_code(
            model_id,
            import_hf_p2r=p2r and not remote_code,
            remote_code=remote_code,
            has_tokenizer=any(file_within(folder, folder / f) for f in _TOKENIZER_FILES),
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


def usage_code(
    model_id: str, *, import_hf_p2r: bool, remote_code: bool, has_tokenizer: bool, one_line: bool = False
) -> str:
    """Python that loads the checkpoint `model_id` (a Hub id or a folder) and, when it has a tokenizer, generates from
    it: what the model card's "How to use" and the trainer's run summary show, runnable as written in a fresh
    process. `import_hf_p2r`: a P2R checkpoint without its modeling code (the import registers the architecture);
    `remote_code`: one with it (config.json's `auto_map`), which `AutoModelForCausalLM` and `AutoTokenizer` (that
    reads config.json too) load with `trust_remote_code=True` instead of asking. `one_line`: its statements joined
    by "; " (no comments), for `python -c`."""
    name = json.dumps(model_id)  # a Python string literal, whatever the name holds
    trust = ", trust_remote_code=True" if remote_code else ""
    lines = [("import hf_p2r", "registers the P2R architecture with transformers")] if import_hf_p2r else []
    lines.append((f"from transformers import AutoModelForCausalLM{', AutoTokenizer' if has_tokenizer else ''}", ""))
    lines.append(("", ""))
    lines.append((f"model = AutoModelForCausalLM.from_pretrained({name}{trust})", ""))
    if has_tokenizer:
        lines += [
            (f"tokenizer = AutoTokenizer.from_pretrained({name}{trust})", ""),
            (f'inputs = tokenizer("{USAGE_PROMPT}", return_tensors="pt")', ""),
            ("outputs = model.generate(**inputs, max_new_tokens=20, do_sample=False)", ""),
            ("print(tokenizer.decode(outputs[0], skip_special_tokens=True))", ""),
        ]
    if one_line:
        return "; ".join(code for code, _ in lines if code)
    return "\n".join(f"{code}  # {comment}" if comment else code for code, comment in lines)


USAGE_PROMPT = "Hello"

__all__ = ["MODEL_CARD_TEMPLATE", "render_model_card", "usage_code"]
