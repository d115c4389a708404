"""Import cycles among one package's modules, imports inside functions included.

    python scripts/import_cycles.py src mtplm

Prints each cycle (a strongly connected component of two or more modules, with the edges inside it) and
exits 1 when there is one, 0 when there is none. An edge is any `import` or `from ... import` anywhere in a
module, resolved to the deepest module of the package it names. Two edges are left out as not being cycles
of design: a package's `__init__` importing its own submodules, and a submodule importing its package (the
interpreter runs that `__init__` first anyway).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement may refer to (a `from` import: the module and each name in
    it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: strip the module itself (unless a package), then one more part per extra dot
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest known module that `name` is or lies inside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def graph(src: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its body)."""
    known = modules(src, package)
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _named(node, module, is_package):
                    target = _resolve(name, known)
                    if target and target != module:
                        targets.add(target)
        edges[module] = {
            t
            for t in targets
            if not (is_package and t.startswith(module + "."))  # __init__ -> its submodule
            and not (known[t].name == "__init__.py" and module.startswith(t + "."))
        }  # -> its package
    return edges


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan's algorithm, iterative)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in order:
            continue
        work = [(root, iter(sorted(edges[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in order:
                    order[step] = low[step] = len(order)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(edges.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], order[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == order[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/import_cycles.py SRC_DIR PACKAGE", file=sys.stderr)
        return 2
    src, package = Path(argv[0]), argv[1]
    edges = graph(src, package)
    cycles = components(edges)
    for members in cycles:
        inside = set(members)
        print(f"cycle of {len(members)}: {', '.join(members)}")
        for module in members:
            for target in sorted(edges[module] & inside):
                print(f"    {module} -> {target}")
    print(f"{len(cycles)} import cycles among {len(edges)} modules of {package}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
