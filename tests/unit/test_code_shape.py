"""The code's shape, checked: small functions, explicit interfaces.

- no function over 60 lines outside the Pallas kernels (a kernel body is one
  program and reads best whole), and no library file over 500 lines outside them;
- no class forwards attributes through ``__getattr__`` (a wrapper states what it
  offers);
- the execution layer's collaborators are typed: no ``Any`` among the constructor
  parameters of the runner, its parts, the executors and the engine clients.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxengine", "server", "sharding", "torch_fallback", "pallas_kernels", "bench")
KERNELS = ROOT / "pallas_kernels"
MAX_LINES = 60
MAX_FILE_LINES = 500
LIBRARY = ("jaxengine", "server", "sharding", "torch_fallback")  # what is installed

TYPED_CONSTRUCTORS = {
    "jaxengine/runner/model_runner.py": ["ModelRunner"],
    "jaxengine/runner/swap.py": ["HostSwapSpace"],
    "jaxengine/runner/request_table.py": ["RequestTable"],
    "jaxengine/executor/local.py": ["LocalExecutor"],
    "jaxengine/executor/multihost.py": ["DriverExecutor", "FollowerLinks"],
    "jaxengine/executor/ray.py": ["RayExecutor", "RayWorker"],
    "jaxengine/entrypoints/async_llm.py": ["AsyncLLM"],
    "jaxengine/entrypoints/dp_async_llm.py": ["DPAsyncLLM"],
    "jaxengine/entrypoints/dp_remote.py": ["RemoteReplica"],
}


def _trees():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def test_no_long_functions_outside_kernels():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path, tree in _trees()
        if KERNELS not in path.parents
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert long == []


def test_no_long_library_files_outside_kernels():
    long = [
        f"{path.relative_to(ROOT)} ({n})"
        for package in LIBRARY
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long == []


def test_no_getattr_forwarding():
    forwarding = [
        f"{path.relative_to(ROOT)}: {cls.name}"
        for path, tree in _trees()
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    assert forwarding == []


def _init_annotations(path: Path, class_name: str) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:] + init.args.kwonlyargs
    return {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in args}


def test_execution_layer_collaborators_are_typed():
    untyped = [
        f"{file} {name}.__init__({arg}: {annotation or '<none>'})"
        for file, classes in TYPED_CONSTRUCTORS.items()
        for name in classes
        for arg, annotation in _init_annotations(ROOT / file, name).items()
        if not annotation or "Any" in annotation.replace("AnyStr", "")
    ]
    assert untyped == []
