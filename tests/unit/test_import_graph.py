"""The library's import graph has no cycle, counting imports inside functions too.

Every ``import``/``from ... import`` of a ``jaxtrain`` module in ``jaxtrain/`` and ``models/``
(installed as ``jaxtrain.models``) is an edge; ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. Two kinds of block never run as part of the
module and are left out: ``if TYPE_CHECKING:`` (annotations only) and ``if __name__ == "__main__":``
(the module run as a script, which is another module object).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"jaxtrain": REPO / "jaxtrain", "jaxtrain.models": REPO / "models"}


def modules(roots: dict[str, Path] = ROOTS) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``roots`` (``{package name: folder}``)."""
    out = {}
    for prefix, base in roots.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _skipped(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or test.replace("'", '"') == '__name__ == "__main__"'


def _imports(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _skipped(child))


def edges(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) pairs between library modules."""
    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = set()
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in filter(None, map(resolve, targets)):
                if target != name:
                    out.add((name, target))
    return out


def cycles(mods: dict[str, Path], graph_edges: set[tuple[str, str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or not (Tarjan's strongly connected components)."""
    graph: dict[str, list[str]] = {m: [] for m in mods}
    for a, b in graph_edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_library_has_no_import_cycle():
    mods = modules()
    found = cycles(mods, edges(mods))
    assert found == [], "modules that import each other:\n" + "\n".join(" <-> ".join(g) for g in found)


def test_the_scanner_sees_a_cycle_inside_a_function_and_not_under_type_checking(tmp_path):
    (tmp_path / "a.py").write_text("import jaxtrain.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from jaxtrain import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jaxtrain.a\n")
    mods = modules({"jaxtrain": tmp_path})
    assert cycles(mods, edges(mods)) == [["jaxtrain.a", "jaxtrain.b"]]
