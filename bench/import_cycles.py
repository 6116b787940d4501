"""The import graph of src/snakeshard and its cycles (strongly connected components of more than one module).

Not a benchmark: the figure issue 28 (layers without circles) asks for before and after. Run from the repository
root: ``python bench/import_cycles.py``. It counts ``import snakeshard...`` and ``from snakeshard... import ...``
at any depth of a module, function-level imports too: they are how today's circles hold together at run time.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "snakeshard").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the snakeshard modules it imports (``from pkg import module`` counts as importing the module)."""
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("snakeshard"):
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in found and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def main() -> None:
    graph = import_graph(modules())
    found = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges, {len(found)} cycles")
    for component in found:
        print(f"  {len(component)}: " + ", ".join(name.removeprefix("snakeshard.") for name in component))


if __name__ == "__main__":
    main()
