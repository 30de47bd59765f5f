"""The library's import graph has no cycle, counting imports inside functions too.

Every ``import``/``from ... import`` of a ``jaxtrain`` module in ``jaxtrain/`` and ``models/``
(installed as ``jaxtrain.models``) is an edge; ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. Two kinds of block never run as part of the
module and are left out: ``if TYPE_CHECKING:`` (annotations only) and ``if __name__ == "__main__":``
(the module run as a script, which is another module object).
"""
from __future__ import annotations

import ast
import re
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


# --- the rooms: kernels behind one registry, packages without cycles, small files and functions

KERNEL_ROOM = "jaxtrain.kernels"
# What code outside the kernel room may import of it: the registry and its operations, never a provider.
KERNEL_API = {"jaxtrain.kernels", "jaxtrain.kernels.registry", "jaxtrain.kernels.hooks", "jaxtrain.kernels.ops",
              "jaxtrain.kernels.context", "jaxtrain.kernels.target", "jaxtrain.kernels.rows"}
# The one documented package cycle (docs/layout.md): a config looks up its family's schema.
ALLOWED_PACKAGE_EDGES_IN_CYCLES = {("config", "models")}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def room(module: str) -> str:
    """A module's room: the folder under jaxtrain/ (``models`` for jaxtrain.models), else the module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_module_outside_the_kernel_room_imports_a_provider_or_names_one():
    mods = modules()
    outside = [(a, b) for a, b in edges(mods) if b.startswith(KERNEL_ROOM) and not a.startswith(KERNEL_ROOM)
               and b not in KERNEL_API]
    assert outside == [], "provider imports outside jaxtrain/kernels/: " + ", ".join(f"{a} -> {b}" for a, b in outside)
    naming = [name for name, path in mods.items()
              if not name.startswith(KERNEL_ROOM) and "cpu_fused" in path.read_text()]
    assert naming == []


def test_the_package_graph_has_no_cycle_but_the_documented_one():
    mods = modules()
    rooms = {room(m): None for m in mods}
    package_edges = {(room(a), room(b)) for a, b in edges(mods) if room(a) != room(b)}
    found = cycles(rooms, package_edges - ALLOWED_PACKAGE_EDGES_IN_CYCLES)
    assert found == [], "packages that import each other:\n" + "\n".join(" <-> ".join(g) for g in found)


def long_functions(mods: dict[str, Path], root: Path = REPO) -> dict[str, int]:
    """``{'path:function': lines}`` of every function (methods and nested ones too) over the limit."""
    out = {}
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(root)}:{node.name}"] = lines
    return out


def test_no_file_over_400_lines_and_no_function_over_60_but_those_docs_layout_names():
    mods = modules()
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in mods.values()}
    big = {path: n for path, n in sizes.items() if n > MAX_FILE_LINES}
    assert big == {}
    layout = (REPO / "docs" / "layout.md").read_text()
    documented = {f"{path}:{fn}": int(n) for path, fn, n in
                  re.findall(r"^\| `([\w/.]+\.py):(\w+)` \| (\d+) \|", layout, re.MULTILINE)}
    assert long_functions(mods) == documented  # a longer one, or a documented one shortened, updates the table


def test_the_checks_see_a_provider_import_and_a_long_function(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "cpu.py").write_text("")
    (tmp_path / "step.py").write_text("from jaxtrain.kernels import cpu\n\ndef f():\n" + "    x = 1\n" * 60)
    mods = modules({"jaxtrain": tmp_path})
    assert ("jaxtrain.step", "jaxtrain.kernels.cpu") in edges(mods)
    assert long_functions(mods, tmp_path) == {"step.py:f": 61}
