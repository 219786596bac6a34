"""The project's modules import each other without circles (read with ``ast``, nothing imported):
boom_ml's, and those of boom_ml, training and data_collection together.

Every import counts, at module level or inside a function: a function-level import still
ties the two modules together, it only hides the circle until the call. Imports under
``if TYPE_CHECKING:`` do not count: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "boom_ml"
PROJECT = tuple(ROOT / name for name in ("boom_ml", "training", "data_collection"))


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """'boom_ml.trace.ops' → its file; a package is named by its ``__init__.py``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement except those under ``if TYPE_CHECKING:`` (its else counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _deepest(dotted: str, modules: dict[str, Path]) -> str | None:
    parts = dotted.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The boom_ml modules ``name`` imports.

    ``from boom_ml.timing import estimate`` imports the module estimate; ``from
    boom_ml.trace.ops import entry_of`` the module ops: the deepest module a name reaches.
    """
    is_package = path.name == "__init__.py"
    targets: set[str | None] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(_deepest(alias.name, modules) for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from the package this module is in
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in modules else _deepest(base, modules))
    return {t for t in targets if t is not None and t != name}


def import_graph(*roots: Path) -> dict[str, set[str]]:
    """Imports among the modules of the packages at ``roots`` (default: boom_ml)."""
    modules: dict[str, Path] = {}
    for root in roots or (PACKAGE,):
        modules.update(module_files(root))
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package has well under 1000 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle(graph, set(c)) for c in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {sorted(component)}")


def test_boom_ml_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in boom_ml:\n" + "\n".join(" -> ".join(c) for c in found)


def test_training_and_data_collection_have_no_import_cycles() -> None:
    graph = import_graph(*PROJECT)
    assert "training.kernel_rows" in graph["training.fold_heads"]  # the graph spans packages
    assert "boom_ml.timing.gemm" in graph["training.train_gemm"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_finds_cycles_and_ignores_type_checking(tmp_path) -> None:
    pkg = tmp_path / "boom_ml"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from boom_ml.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from boom_ml.sub.c import g\n")
    (pkg / "sub" / "c.py").write_text("from ..a import x\n")  # function-level + relative
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import boom_ml.e\n"
    )
    (pkg / "e.py").write_text("import boom_ml.d\n")
    graph = import_graph(pkg)
    assert graph["boom_ml.a"] == {"boom_ml.sub.b"}
    assert graph["boom_ml.sub.c"] == {"boom_ml.a"}
    assert graph["boom_ml.d"] == set()
    assert cycles(graph) == [["boom_ml.a", "boom_ml.sub.b", "boom_ml.sub.c", "boom_ml.a"]]
