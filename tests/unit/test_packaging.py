"""What the distribution installs: the library's packages, not the repository's
``bench/`` scripts; what `jaxengine bench` runs ships inside ``jaxengine``."""

from __future__ import annotations

import fnmatch
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _installed(package: str) -> bool:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    included = any(fnmatch.fnmatch(package, p) for p in find.get("include", ["*"]))
    excluded = any(fnmatch.fnmatch(package, p) for p in find.get("exclude", []))
    return included and not excluded


def test_bench_is_not_installed():
    assert not _installed("bench")
    assert not _installed("bench.serve_peers")
    assert _installed("jaxengine") and _installed("jaxengine.benchmarks")


def test_the_bench_command_needs_only_the_package():
    from jaxengine.cli.bench import BENCHMARKS

    for module_name, _ in BENCHMARKS.values():
        assert module_name.startswith("jaxengine.benchmarks."), module_name
        module = importlib.import_module(module_name)
        assert Path(module.__file__).resolve().is_relative_to(ROOT / "jaxengine")
