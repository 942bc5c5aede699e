"""No import circles in ``src/microplan``: every import counts, module-level, inside functions or
under ``TYPE_CHECKING``.

A circle makes the import order matter (one side must import late, or at the bottom), hides
which module owns a concept, and breaks the first time someone moves an import. The graph is
built from the source with ``ast`` (nothing is imported): an edge A → B for every ``import`` /
``from ... import`` in A that names module B of the package, resolved relative imports included,
and ``from package import name`` counts as an import of ``package.name`` when that is a module
(else of the package's ``__init__``, so a submodule reaching back into its package's
``__init__``, which imports it, is a circle too).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = "microplan"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """module → the package modules it imports (anywhere in its source)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.append(full if full in mods else base)
            for t in targets:
                while t and t not in mods:  # ``import microplan.cost.cp`` names a module; trim attributes
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_kind_of_import():
    """The detector itself: it finds a lazy import and a TYPE_CHECKING one (or the test could not fail)."""
    g = import_graph()
    assert "microplan.planner" in g["microplan"]  # the package re-exports plan
    assert "microplan.config" in g["microplan.fixes"]  # a TYPE_CHECKING-only import
    assert "microplan.stages.padded" in g["microplan.forward"] or "microplan.planner" in g["microplan.forward"]
    assert "microplan.prefix" in g["microplan.footprint"] or "microplan.trie" in g["microplan.footprint"]  # lazy
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (module-level, lazy or TYPE_CHECKING imports):\n" + \
        "\n".join(" ↔ ".join(c) for c in found)
