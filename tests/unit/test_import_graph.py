"""No import cycle anywhere in the project's packages, between modules or folders.

Builds the module import graph from the source (every ``import`` statement,
including the ones inside functions and under ``TYPE_CHECKING``: a cycle through a
lazy import is still a cycle of design) and fails on any strongly connected
component of more than one module, naming it. The same on the folder graph: a
folder's modules (the ``.py`` files directly in it) taken together, so that every
folder depends one way on the folders below it (docs/architecture.md, "Dependency
rule").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxengine", "server", "sharding", "pallas_kernels", "torch_fallback")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` names in its import statements."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def packages() -> set[str]:
    """The modules that are a package's ``__init__``."""
    return {name for name, path in _modules().items() if path.name == "__init__.py"}


def folder_of(module: str, packages: set[str]) -> str:
    """The folder holding ``module``: a package's ``__init__`` belongs to its own."""
    return module if module in packages else module.rpartition(".")[0]


def folder_graph(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        mine = folders.setdefault(folder_of(module, packages), set())
        mine.update(folder_of(m, packages) for m in imported)
    for folder, imported in folders.items():
        imported.discard(folder)
        for other in imported:
            folders.setdefault(other, set())
    return folders


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "jaxengine.worker.build" in graph["jaxengine.executor"]
    assert len(graph) > 100


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_folder_graph_takes_a_folders_modules_together():
    graph = {"p.a": {"q.b"}, "q.b": set(), "q": {"p.c"}, "p.c": set()}
    assert cycles(graph) == []  # no cycle of modules ...
    assert cycles(folder_graph(graph, {"q"})) == [["p", "q"]]  # ... but one of folders
    found = packages()
    assert folder_of("jaxengine.runner.batch", found) == "jaxengine.runner"
    assert folder_of("jaxengine.runner", found) == "jaxengine.runner"
    assert folder_of("jaxengine.speculative.device", found) == "jaxengine.speculative.device"


def test_no_import_cycles_between_folders():
    assert cycles(folder_graph(import_graph(), packages())) == []
