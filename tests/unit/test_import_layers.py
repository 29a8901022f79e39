"""The package's layering, read from the source: services meet only through ``kvmesh.common`` (and
the protos and subjects it defines), no import cycles, no module shadowing the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "services"
SERVICES = ("frontend", "router", "indexer", "worker", "planner")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kvmesh", *parts))


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "proto" not in p.relative_to(PACKAGE).parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """kvmesh modules a file imports at module level (``TYPE_CHECKING`` blocks excluded)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            names: list[str] = []
            if isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            elif isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                names = [inner.module] + [f"{inner.module}.{a.name}" for a in inner.names]
            found |= {n for n in names if n in known}
    return found


GRAPH = {name: imports_of(path, set(modules())) for name, path in modules().items()}


def owner(module: str) -> str | None:
    """The service a module belongs to, or None for common code and tools."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SERVICES else None


def test_services_import_only_common_code_and_themselves():
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if owner(module)
        for target in targets
        if owner(target) not in (None, owner(module)) or target.split(".")[1:2] in (["replay"], ["loadgen"])
    ]
    assert offenders == []


def test_common_code_imports_no_service():
    offenders = [
        f"{m} imports {t}" for m, targets in GRAPH.items() if m.startswith("kvmesh.common") for t in targets if owner(t)
    ]
    assert offenders == []


def test_there_are_no_import_cycles():
    # depth-first search for a back edge; the path to it is the cycle
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if target == module or (target == module.rsplit(".", 1)[0] and module.endswith("__main__")):
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target] if target in path else [module, target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("folder", sorted({p.parent for p in PACKAGE.rglob("*.py")}), ids=str)
def test_no_module_shadows_the_standard_library(folder: Path):
    """A file run as a script puts its folder first on sys.path; a ``services/inspect.py`` then
    hid the standard library's ``inspect`` and crashed the script with a circular import."""
    shadows = sorted(p.stem for p in folder.glob("*.py") if p.stem in sys.stdlib_module_names)
    assert shadows == []


# kvmesh.common's layers, bottom first: a layer imports only itself and the layers before it
COMMON_LAYERS = ("proto", "wire", "core", "rpc", "runtime", "calling")


def common_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["kvmesh", "common"] or len(parts) < 3 or parts[2] not in COMMON_LAYERS:
        return None
    return COMMON_LAYERS.index(parts[2])


def test_common_layers_import_only_the_layers_below_them():
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if (layer := common_layer(module)) is not None
        for target in targets
        if (common_layer(target) or 0) > layer
    ]
    assert any(common_layer(m) == COMMON_LAYERS.index("calling") for m in GRAPH)  # the layers were found
    assert offenders == []
