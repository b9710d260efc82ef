"""The import graph of hf_p2r, read with `ast` (no third-party tool): no cycles, imports only point down the layers,
and no module reaches into another's private names.

The layers, from the bottom (STYLE.md: "import direction is architecture"): `errors`, `compat` (the one place for
private reads of other libraries) and `lazy` import nothing of hf_p2r; `models` (the model files know nothing of
checkpoints, parallelism or training) and `ops` (compute kernels in plain torch); `checkpoint` (every tensor read and
write, and the model card); `hub` (pushes folders); `distributed` (parallelism applied to a model from outside);
`planning` (sizes layouts from what the models and `distributed` say) and `config` (the trainer's configuration,
torch-free, which the planner reads too); `training` (the loop and its engines: granular offload is
`distributed.offload`, applied from outside the model, with a thin adapter in `training.offload`); `integrations`
(P2R inside transformers' Trainer, built on `training`'s delink and carry); the command lines (`cli`, `commands`, the
trainer's entry point `train`). The package's `__init__` is its facade and may name anything. Every import counts, at
module level or inside a function: a deferred import is still an arrow.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_p2r"
# A module's layer is that of its longest listed prefix; a module imports only modules of its layer or below.
LAYERS = {
    "hf_p2r.errors": 0,
    "hf_p2r.compat": 0,
    "hf_p2r.lazy": 0,  # lazy_exports: names of a package loaded on first use
    "hf_p2r.models": 1,
    "hf_p2r.ops": 1,  # compute kernels in plain torch (a model or an engine may call them)
    "hf_p2r.checkpoint": 2,
    "hf_p2r.hub": 3,
    "hf_p2r.distributed": 4,
    "hf_p2r.distributed.offload": 4,  # granular offload: below the trainer, above the model (which knows nothing of it)
    "hf_p2r.planning": 5,
    "hf_p2r.config": 5,  # the trainer's configuration (torch-free; the planner reads a trainer YAML with it)
    "hf_p2r.training": 6,
    "hf_p2r.integrations": 7,  # P2R in transformers' Trainer and TRL (a callback and a Trainer subclass)
    "hf_p2r.train": 7,
    "hf_p2r.commands": 7,
    "hf_p2r.cli": 7,
    "hf_p2r": 8,  # the package's __init__
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported hf_p2r module, imported name or "", line) for every import in module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names if alias.name.startswith("hf_p2r")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "hf_p2r" or target.startswith("hf_p2r."):
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    found.append(
                        (submodule, "", node.lineno) if submodule in MODULES else (target, alias.name, node.lineno)
                    )
    return found


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_package_has_the_layers_it_declares():
    assert {"hf_p2r.models", "hf_p2r.checkpoint", "hf_p2r.distributed", "hf_p2r.training"} <= MODULES.keys()
    assert {"hf_p2r.distributed.offload", "hf_p2r.distributed.offload.granular"} <= MODULES.keys()
    assert all(_layer(module) is not None for module in MODULES)


def test_imports_only_point_down_the_layers():
    upward = {
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)}), line {line}"
        for module, imports in GRAPH.items()
        for target, _, line in imports
        if target in MODULES and _layer(target) > _layer(module)
    }
    assert not upward, "\n".join(sorted(upward))


def test_distributed_models_checkpoint_and_planning_never_import_training():
    lower = ("hf_p2r.distributed", "hf_p2r.models", "hf_p2r.checkpoint", "hf_p2r.planning")
    found = {
        f"{module} imports {target}"
        for module, imports in GRAPH.items()
        if module.startswith(lower)
        for target, _, _ in imports
        if target.startswith("hf_p2r.training")
    }
    assert not found, "\n".join(sorted(found))


def test_the_model_knows_nothing_of_offload_and_offload_nothing_of_the_trainer():
    """The model files import no offload module; `distributed.offload` imports neither the trainer nor the planner
    (the planner imports its formula from there)."""
    found = {
        f"{module} imports {target}"
        for module, imports in GRAPH.items()
        for target, _, _ in imports
        if (module.startswith("hf_p2r.models") and target.startswith("hf_p2r.distributed.offload"))
        or (
            module.startswith("hf_p2r.distributed.offload")
            and target.startswith(("hf_p2r.training", "hf_p2r.planning"))
        )
    }
    assert not found, "\n".join(sorted(found))
    assert any(t.startswith("hf_p2r.distributed.offload") for t, _, _ in GRAPH["hf_p2r.planning.memory"])


def test_no_import_cycles():
    edges = {module: {target for target, _, _ in imports if target in MODULES} for module, imports in GRAPH.items()}
    # Packages import their own submodules to re-export them: that arrow is the facade, not a dependency.
    edges = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in edges.items()}
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    found = [
        f"{module} imports {name} from {target}, line {line}"
        for module, imports in GRAPH.items()
        for target, name, line in imports
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("from ..training.train import _record\n", "imports _record"),
        ("from ..training import config\n", "imports hf_p2r.training.config"),
    ],
)
def test_the_checks_can_fail(tmp_path, monkeypatch, source, message):
    """The reader sees a private import and an upward arrow in a module placed in the distributed layer."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    imports = _imports("hf_p2r.distributed.probe", path)
    target, name, _ = imports[0]
    described = f"imports {name}" if name else f"imports {target}"
    assert described == message
    assert name.startswith("_") or _layer(target) > _layer("hf_p2r.distributed.probe")
