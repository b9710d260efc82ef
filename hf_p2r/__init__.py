"""hf-p2r: Pseudo-to-Real pretraining (M6-10T) for Hugging Face Transformers.

`import hf_p2r` is light: the names below load on first use (PEP 562), and the Auto classes (`AutoConfig`,
`AutoModel`, `AutoModelForCausalLM`) learn the `p2r` and `p2r_moe` model types when transformers loads them, or at
once if it already has. So `from transformers import AutoModelForCausalLM` after `import hf_p2r` finds P2R, as it
always did, while the `hf-p2r` command line (which imports this package) starts without torch or transformers.
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
# The transformers modules that define the Auto classes: P2R is registered as soon as either has loaded, or the model
# module has (when it is the one that made transformers load them, registering waits for it to finish).
_AUTO_MODULES = ("transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto")
_MODEL_MODULES = (
    "hf_p2r.models.p2r.configuration_p2r",
    "hf_p2r.models.p2r.modeling_p2r",
    "hf_p2r.models.p2r.configuration_p2r_moe",
    "hf_p2r.models.p2r.modeling_p2r_moe",
)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def register_auto_classes() -> None:
    """Register P2R with transformers' `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (idempotent).

    Runs by itself when transformers loads its Auto classes after `import hf_p2r`; call it only to register at a
    moment of your choosing."""
    _register()


def _register(just_run: str | None = None) -> None:
    """`register_auto_classes`, called by the import hook right after module `just_run` ran."""
    if _registering or any(_initializing(name) for name in _MODEL_MODULES if name != just_run):
        return  # re-entered (loading AutoModel loads modeling_auto), or called again when the model module is done
    _registering.append(True)
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        from .models.p2r import P2RConfig, P2RForCausalLM, P2RModel, P2RMoeConfig, P2RMoeForCausalLM, P2RMoeModel

        for config, model, causal_lm in (
            (P2RConfig, P2RModel, P2RForCausalLM),
            (P2RMoeConfig, P2RMoeModel, P2RMoeForCausalLM),
        ):
            AutoConfig.register(config.model_type, config, exist_ok=True)
            AutoModel.register(config, model, exist_ok=True)
            AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)
    finally:
        _registering.clear()
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


_registering: list[bool] = []


def _initializing(name: str) -> bool:
    """Whether module `name` is being imported right now (in sys.modules, not yet run to the end)."""
    return getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False)


class _RegisterWhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets the other finders find the Auto modules and calls `register_auto_classes` once the
    module has run (transformers loads its submodules lazily, so this is when the Auto classes come to exist)."""

    def find_spec(self, name, path, target=None):
        if name not in _AUTO_MODULES + _MODEL_MODULES:
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

        def exec_and_register(module):
            exec_module(module)
            _register(just_run=name)

        spec.loader.exec_module = exec_and_register
        return spec


_hook = _RegisterWhenLoaded()
if any(name in sys.modules for name in _AUTO_MODULES):
    _register()
else:
    sys.meta_path.insert(0, _hook)

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
