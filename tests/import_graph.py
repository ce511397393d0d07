"""The import graph of our packages, read from the source (no import is executed), and its structure drawing.

    python -m tests.import_graph            # floors of the whole project, then of runtime/ (docs/structure.md)

Edges: every `import` / `from ... import` of one of our modules, at module level or anywhere else, except inside
an `if TYPE_CHECKING:` block (annotations only; never executed). `from pkg import name` is an edge to the module
`pkg.name` when that is a module, else to `pkg`. An import inside a function body is recorded separately: the
rule is that none exists (tests/test_imports.py).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "data", "training", "runtime", "bench")
# package -> the packages it may import (itself included): heads <- runtime <- data <- training, runtime <- bench
# (data's `runtime` engine answers with our own decode loop)
ALLOWED = {"heads": {"heads"}, "data": {"heads", "runtime", "data"}, "training": {"heads", "data", "training"},
           "runtime": {"heads", "runtime"}, "bench": set(PACKAGES)}


@dataclass
class Graph:
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it imports
    nested: list[tuple[str, int, str]] = field(default_factory=list)  # (module, line, imported) in a function body


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """'runtime.proposers.base' -> its file, for every .py file of our packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, in_function: bool = False):
    """(node, in_function) for every import statement, skipping `if TYPE_CHECKING:` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]), in_function)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(node, inside)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    out = []
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        while name and name not in modules:  # `import runtime.proposers.base.x` style: the longest module prefix
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def build_graph(root: Path = ROOT) -> Graph:
    modules = module_files(root)
    graph = Graph({name: set() for name in modules})
    for module, path in modules.items():
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, path, node, modules):
                graph.edges[module].add(target)
                if in_function:
                    graph.nested.append((module, node.lineno, target))
    return graph


def upward_edges(graph: Graph) -> list[tuple[str, str]]:
    """Edges that break the package rule (e.g. runtime -> data, heads -> runtime)."""
    return sorted((a, b) for a, targets in graph.edges.items() for b in targets
                  if b.split(".")[0] not in ALLOWED[a.split(".")[0]])


def floors(edges: dict[str, set[str]]) -> list[list[str]]:
    """Modules by floor: floor 0 imports none of the others, floor k imports only floors < k. Raises
    graphlib.CycleError naming a circle if there is one."""
    order = list(TopologicalSorter(edges).static_order())
    level: dict[str, int] = {}
    for module in order:
        level[module] = 1 + max((level[d] for d in edges.get(module, ()) if d in level), default=-1)
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for module, k in level.items():
        if module in edges:
            out[k].append(module)
    return [sorted(f) for f in out]


def drawing(edges: dict[str, set[str]], title: str) -> str:
    lines = [f"{title}: {len(edges)} modules, {sum(len(t) for t in edges.values())} imports, no circle"]
    for k, modules in reversed(list(enumerate(floors(edges)))):
        lines.append(f"  floor {k:2d}: " + ", ".join(modules))
    return "\n".join(lines)


def main() -> None:
    graph = build_graph()
    runtime = {m: {t for t in ts if t.startswith("runtime")} for m, ts in graph.edges.items()
               if m.startswith("runtime")}
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for a, targets in graph.edges.items():
        packages[a.split(".")[0]] |= {t.split(".")[0] for t in targets} - {a.split(".")[0]}
    print(drawing(packages, "packages"))
    print()
    print(drawing(runtime, "runtime/"))
    print()
    print(drawing(graph.edges, "whole project"))
    if graph.nested or upward_edges(graph):
        print(f"rule broken: {len(graph.nested)} imports in function bodies, {len(upward_edges(graph))} upward",
              file=sys.stderr)


if __name__ == "__main__":
    main()
