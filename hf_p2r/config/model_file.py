"""`model_config`: a model described the way users describe one, by a Llama or P2R `config.json`, read into the
trainer's model fields.

The value is a JSON file, a model folder holding `config.json`, or the id of a Hub model already in the local Hugging
Face cache (read offline: nothing is downloaded). Its fields become the model fields' values below the YAML file and
the flags (which override them); Llama's `rope_parameters` (transformers v5) or `rope_theta` + `rope_scaling` (v4)
become `rope_theta` and `rope_scaling`; a pseudo P2R config's `num_unique_layers` its k. The fields of a config that
the trainer sets itself (the tokenizer's special tokens, dtype, cache use) are left out; any other field the trainer
does not take is refused, naming it, rather than dropped. Plain Python (no torch, no transformers).
"""

from pathlib import Path
from typing import Any

from ..checkpoint.io import CONFIG_NAME, read_config_dict
from ..errors import read_json
from .fields import ConfigError, short

# The model types whose config.json the trainer reads: Llama's fields, P2R's (Llama's plus the sharing fields), and
# the MoE fields of P2R's mixture-of-experts model.
MODEL_TYPES = ("llama", "p2r", "p2r_moe")
# Fields of a config.json that the trainer decides itself (the tokenizer's special tokens, the dtype and cache of
# loading, transformers' bookkeeping), or that describe no weights: read past.
SET_BY_THE_TRAINER = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "pretraining_tp",
        "problem_type",
        "return_dict",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


def read_model_config(value: str, fields: set[str]) -> tuple[str, dict[str, Any]]:
    """(the file read, {trainer field: value}) of `model_config` `value`, for the model fields named in `fields`;
    `ConfigError` naming `model_config` and the file for a missing or unreadable file, another model type, or a field
    the trainer does not take."""
    path = find_model_config(value)
    shown = short(str(path))[1:-1]
    try:
        values = read_config_dict(path.parent) if path.name == CONFIG_NAME else read_json(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model_config: {error}") from None
    model_type = values.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model_config: {shown}: model_type {short(model_type)} is not a Llama or P2R model "
            f"({', '.join(MODEL_TYPES)})"
        )
    found = dict(values)
    rope = found.pop("rope_parameters", None)
    if isinstance(rope, dict):  # transformers v5: rope_theta inside, with the scaling's fields
        found.setdefault("rope_theta", rope.get("rope_theta"))
        scaling = {key: item for key, item in rope.items() if key != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            found.setdefault("rope_scaling", scaling)
    elif rope is not None:
        raise ConfigError(f"model_config: {shown}: rope_parameters: expected a mapping, got {short(rope)}")
    sharing = found.pop("share_layers", False), found.pop("num_unique_layers", None)
    if sharing[0] is True and model_type != "llama":  # a pseudo model's k (a real one's is its depth)
        found["num_unique_layers"] = sharing[1]
    if found.get("rope_scaling") is None:
        found.pop("rope_scaling", None)
    unknown = sorted(key for key in found if key not in fields and key not in SET_BY_THE_TRAINER)
    if unknown:
        names = ", ".join(short(key) for key in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise ConfigError(
            f"model_config: {shown}: {names}: not a field of the trainer's model (a Llama or P2R config's fields); "
            "remove them from the file"
        )
    return str(path), {key: item for key, item in found.items() if key in fields}


def find_model_config(value: str) -> Path:
    """The config.json (or JSON file) `model_config` names: a file, a folder's config.json, or the cached config.json
    of a Hub model id (`huggingface_hub.try_to_load_from_cache`: the local cache only)."""
    path = Path(value)
    if path.is_dir():
        return path / CONFIG_NAME
    if path.exists():
        return path  # a file (read_json refuses what is not a regular one)
    if value.startswith((".", "/", "~")) or value.endswith(".json") or value.count("/") > 1:
        raise ConfigError(f"model_config: {short(value)[1:-1]}: no such file or folder")
    cached = None
    if 0 < len(value) < 200 and value.count("/") <= 1:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(value, CONFIG_NAME)
        except (ValueError, OSError):  # not a valid repository id
            cached = None
    if not isinstance(cached, str):
        raise ConfigError(
            f"model_config: {short(value)} is not a file, a model folder or a model in the local Hugging Face cache "
            f"(nothing is downloaded: `hf download {short(value)[1:-1]} config.json` fetches it)"
        )
    return Path(cached)


__all__ = ["MODEL_TYPES", "SET_BY_THE_TRAINER", "find_model_config", "read_model_config"]
