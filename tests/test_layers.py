"""Layers point one way: the import graph of archlab's packages has no cycle, counting imports
inside functions too (a lazy import is still a dependency), and the model's modules import no
module that imports them back. ``if TYPE_CHECKING:`` imports are annotations only and not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import archlab

SRC = Path(archlab.__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "archlab").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every archlab module ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := walk(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := walk(v)) is not None:
            return found
    return None


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_packages_import_one_way():
    packages: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        packages.setdefault(_package(module), set()).update(
            _package(d) for d in deps if _package(d) != _package(module))
    cycle = _cycle(packages)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_model_modules_have_no_import_circle():
    graph = {m: {d for d in deps if d.startswith("archlab.model")}
             for m, deps in _graph().items() if m.startswith("archlab.model")}
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_model_imports_nothing_above_it():
    allowed = {"archlab.model", "archlab.kernels", "archlab.typed", "archlab.errors"}
    above = {(m, d) for m, deps in _graph().items() if m.startswith("archlab.model.") or m == "archlab.model"
             for d in deps if _package(d) not in allowed}
    assert not above


def test_io_imports_no_consumer_of_checkpoints():
    consumers = {"archlab.train", "archlab.eval", "archlab.infer", "archlab.convert", "archlab.analysis",
                 "archlab.lab", "archlab.data", "archlab.cli"}
    up = {(m, d) for m, deps in _graph().items() if _package(m) == "archlab.io"
          for d in deps if _package(d) in consumers}
    assert not up
