"""hf-p2r: Pseudo-to-Real pretraining (M6-10T) for Hugging Face Transformers.

`import hf_p2r` is light: the names below load on first use (PEP 562), and the Auto classes (`AutoConfig`,
`AutoModel`, `AutoModelForCausalLM`) learn the `p2r` and `p2r_moe` model types as names when transformers loads them
(or at once if it already has), importing the P2R classes only when they first look one up, as they do for
transformers' own models. So `AutoModelForCausalLM.from_pretrained(p2r_folder)` works after `import hf_p2r` in any
import order, nothing runs inside transformers' own imports, and the `hf-p2r` command line (which imports this
package) starts without torch or transformers.
"""

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "P2RConfig": ".models.p2r",
    "P2RForCausalLM": ".models.p2r",
    "P2RModel": ".models.p2r",
    "P2RPreTrainedModel": ".models.p2r",
    "block_of_depth": ".models.p2r",
    "delink_sources": ".models.p2r",
    "P2RMoeConfig": ".models.p2r",
    "P2RMoeForCausalLM": ".models.p2r",
    "P2RMoeModel": ".models.p2r",
    "export_mixtral": ".checkpoint",
    "mixtral_config": ".checkpoint",
    "convert_pseudo_to_real": ".checkpoint",
    "export_llama": ".checkpoint",
    "llama_config": ".checkpoint",
    "push_to_hub": ".hub",
}
_CONFIG = "hf_p2r.models.p2r.configuration_p2r:P2RConfig"
_MOE_CONFIG = "hf_p2r.models.p2r.configuration_p2r_moe:P2RMoeConfig"
_MODELING = "hf_p2r.models.p2r.modeling_p2r"
_MOE_MODELING = "hf_p2r.models.p2r.modeling_p2r_moe"
# What the Auto classes learn, by transformers module and mapping: names, imported on first lookup (see `_defer`).
_AUTO_ENTRIES = {
    "transformers.models.auto.configuration_auto": {
        "CONFIG_MAPPING": {"p2r": _CONFIG, "p2r_moe": _MOE_CONFIG},
    },
    "transformers.models.auto.modeling_auto": {
        "MODEL_MAPPING": {_CONFIG: f"{_MODELING}:P2RModel", _MOE_CONFIG: f"{_MOE_MODELING}:P2RMoeModel"},
        "MODEL_FOR_CAUSAL_LM_MAPPING": {
            _CONFIG: f"{_MODELING}:P2RForCausalLM",
            _MOE_CONFIG: f"{_MOE_MODELING}:P2RMoeForCausalLM",
        },
    },
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def register_auto_classes() -> None:
    """Register P2R with transformers' `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` now (idempotent).

    Not needed: `import hf_p2r` already makes the Auto classes find P2R, in whatever order transformers is imported.
    This imports the classes at once (torch and transformers included), as `AutoModel.register` needs them."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .models.p2r import P2RConfig, P2RForCausalLM, P2RModel, P2RMoeConfig, P2RMoeForCausalLM, P2RMoeModel

    for config, model, causal_lm in (
        (P2RConfig, P2RModel, P2RForCausalLM),
        (P2RMoeConfig, P2RMoeModel, P2RMoeForCausalLM),
    ):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)


def _defer(module) -> None:
    """Give the Auto mappings of transformers module `module` (just run) the P2R entries, as names.

    Nothing is imported here: this runs inside transformers' own imports (right after `module` has run, while the
    module that imported it may still be half-initialised), where importing the P2R classes, and with them
    transformers' modeling code, would fail. The classes load when the Auto classes first look one up."""
    from .compat import defer_auto_registration

    for mapping, entries in _AUTO_ENTRIES[module.__name__].items():
        defer_auto_registration(getattr(module, mapping), entries)


class _DeferWhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets the other finders find transformers' Auto modules and gives their mappings the
    P2R entries once each has run (transformers loads its submodules lazily, so that is when the mappings exist)."""

    def find_spec(self, name, path, target=None):
        if name not in _AUTO_ENTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_defer(module):
            exec_module(module)
            _defer(module)
            if all(other in sys.modules for other in _AUTO_ENTRIES) and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_and_defer
        return spec


def _install() -> None:
    loaded = [sys.modules[name] for name in _AUTO_ENTRIES if name in sys.modules]
    for module in loaded:
        if all(hasattr(module, mapping) for mapping in _AUTO_ENTRIES[module.__name__]):
            _defer(module)
    if len(loaded) < len(_AUTO_ENTRIES):
        sys.meta_path.insert(0, _DeferWhenLoaded())


_install()

__all__ = [
    "P2RConfig",
    "P2RForCausalLM",
    "P2RModel",
    "P2RMoeConfig",
    "P2RMoeForCausalLM",
    "P2RMoeModel",
    "P2RPreTrainedModel",
    "block_of_depth",
    "convert_pseudo_to_real",
    "delink_sources",
    "export_llama",
    "export_mixtral",
    "llama_config",
    "mixtral_config",
    "push_to_hub",
    "register_auto_classes",
]
