"""No import cycle anywhere in the project's packages, between modules or folders.

Builds the module import graph from the source (every ``import`` statement,
including the ones inside functions and under ``TYPE_CHECKING``: a cycle through a
lazy import is still a cycle of design) and fails on any strongly connected
component of more than one module, naming it. The same on the folder graph: a
folder's modules (the ``.py`` files directly in it) taken together, so that every
folder depends one way on the folders below it (docs/architecture.md, "Dependency
rule").

The server's own layout (docs/architecture.md, ``server/``): one folder per API over
what the APIs share. The shared modules (``server/*.py``, ``server/chat_rendering/``,
``server/tool_parsers/``) import no API folder; only the process layer,
``server/api_server/`` (the app factory, flags, launch), imports them, and no API
imports it back. No folder of the server holds more than 15 modules.
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


SERVER_APIS = ("chat", "completions", "responses", "messages", "decisions", "pooling", "batch",
               "dev")  # fmt: skip
SERVER_SHARED = ("server", "server.chat_rendering", "server.tool_parsers")
SERVER_APP = "server.api_server"
MAX_SERVER_FOLDER_MODULES = 15


def test_the_server_folders_are_the_ones_named_here():
    """Every folder of ``server/`` is an API, shared, or the app layer (so a new folder
    is placed on purpose)."""
    found = packages()
    folders = {folder_of(m, found) for m in import_graph() if m.split(".")[0] == "server"}
    apis = {f"server.{api}" for api in SERVER_APIS}
    assert folders == apis | set(SERVER_SHARED) | {SERVER_APP}


def test_shared_server_modules_import_no_api_folder():
    """What the APIs share depends on no API: an API's folder can move or go without
    touching them. Only the app layer (server/api_server/) imports the API folders."""
    found, graph = packages(), import_graph()
    apis = {f"server.{api}" for api in SERVER_APIS}
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        if folder_of(module, found) in SERVER_SHARED
        for imported in imports
        if folder_of(imported, found) in apis | {SERVER_APP}
    )
    assert wrong == []


def test_no_api_folder_imports_the_app_layer():
    found, graph = packages(), import_graph()
    apis = {f"server.{api}" for api in SERVER_APIS}
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        if folder_of(module, found) in apis
        for imported in imports
        if folder_of(imported, found) == SERVER_APP
    )
    assert wrong == []


def test_no_server_folder_over_15_modules():
    """A folder of ``server/`` holds at most 15 modules (its ``__init__`` counted)."""
    folders = {path.parent for path in (ROOT / "server").rglob("*.py")}
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in folders
        if (n := len(list(folder.glob("*.py")))) > MAX_SERVER_FOLDER_MODULES
    }
    assert crowded == {}
