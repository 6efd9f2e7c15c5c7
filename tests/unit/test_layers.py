"""The package's layers, enforced: imports run one way only, the adapters reach the core only
through its one door (``hvdlite.common.core``), and no import cycle exists.

Every ``import`` in ``hvdlite/`` counts, at module level or inside a function (a lazy import is
still a dependency), except under ``if TYPE_CHECKING:``.  The layers, lowest first, are listed
in :data:`LAYERS`; docs/how-it-works.md draws the same map.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvdlite"

# (layer, module-name prefixes), lowest first: a module may import its own layer and below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("hvdlite.version", "hvdlite.common.errors", "hvdlite.common.reduce_ops",
                    "hvdlite.common.dtypes", "hvdlite.common.config", "hvdlite.common.knob_kinds",
                    "hvdlite.common.memory")),
    ("gpu", ("hvdlite.common.gpu",)),
    ("runtime", ("hvdlite.common.runtime",)),
    ("tuning", ("hvdlite.common.tuning",)),
    ("intranode", ("hvdlite.common.intranode",)),
    ("engine", ("hvdlite.common.engine",)),
    ("data_paths", ("hvdlite.common.data_paths",)),
    ("api", ("hvdlite.common.api",)),
    ("door", ("hvdlite.common.core",)),
    ("adapters", ("hvdlite.torch", "hvdlite.tensorflow", "hvdlite.jax", "hvdlite.keras",
                  "hvdlite.runner", "hvdlite.ray", "hvdlite.spark")),
]
# Package markers that import nothing and belong to no layer.
NEUTRAL = {"hvdlite.common"}
ADAPTER_PREFIXES = LAYERS[-1][1]
DOOR = "hvdlite.common.core"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> set[str]:
    """Every hvdlite module ``module`` imports (``from X import y`` counts as ``X.y`` when
    ``X.y`` is a module, else ``X``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("hvdlite"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.startswith("hvdlite"):
                    for alias in child.names:
                        found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                                  else base)
            visit(child)

    visit(tree)
    return {m for m in found if m != module}


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: _imports(path, name) for name, path in MODULES.items()}


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != "hvdlite" and m not in NEUTRAL
                      and layer_of(m) is None)
    assert not unplaced, f"modules outside every layer (add them to LAYERS): {unplaced}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    own = layer_of(module) if module != "hvdlite" else len(LAYERS) - 1
    if own is None:
        return
    upward = sorted(f"{target} ({LAYERS[layer_of(target)][0]})" for target in GRAPH[module]
                    if layer_of(target) is not None and layer_of(target) > own)
    assert not upward, (f"{module} ({LAYERS[own][0]}) imports from a higher layer: "
                        f"{upward}")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m == "hvdlite" or any(
    m == p or m.startswith(p + ".") for p in ADAPTER_PREFIXES)))
def test_adapters_use_only_the_door(module):
    side_doors = sorted(t for t in GRAPH[module]
                        if t.startswith("hvdlite.common") and t != DOOR
                        and not t.startswith(DOOR + "."))
    assert not side_doors, f"{module} reaches into the core past {DOOR}: {side_doors}"


def test_no_import_cycles():
    # Tarjan's strongly connected components over hvdlite's own modules.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            strong(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_planted_violation(tmp_path):
    """The checker itself: an upward import and a side door are found."""
    planted = tmp_path / "x.py"
    planted.write_text("import os\nfrom hvdlite.common.engine import engine\n"
                       "def f():\n    from hvdlite.common.api import ops\n")
    found = _imports(planted, "hvdlite.common.runtime.x")
    assert {"hvdlite.common.engine.engine", "hvdlite.common.api.ops"} <= found
