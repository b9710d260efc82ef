"""The names a package exports, each imported from its submodule the first time it is asked for (PEP 562), so that
importing one light submodule (the converter's torch-free modules, the planner's assumptions) does not import every
heavy one beside it. Plain Python; it imports nothing of hf_p2r.
"""

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
    """(`__getattr__`, `__dir__`, `__all__`) for the package named `package` exporting, from each of its submodules
    (relative names), the names listed for it. A name is imported on its first lookup and then kept in the package,
    so later lookups are ordinary ones.

    ```python
    __getattr__, __dir__, __all__ = lazy_exports(__name__, {".reader": ("CheckpointReader",), ".io": ("file_within",)})
    ```
    """
    module_of = {name: module for module, names in modules.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)


__all__ = ["lazy_exports"]
