"""A name -> class registry with plugin loading, shared by the reasoning parsers and the
server's tool-call parsers (`server.tool_parsers`).

`--reasoning-parser-plugin` / `--tool-parser-plugin` name a `.py` file or an importable
module; importing it runs its `@register_...(name)` decorators. A later registration
under an existing name replaces the earlier one, so a plugin may override a built-in.

Pure Python: no jax.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class ParserRegistry(Generic[T]):
    """Parsers of one kind by name; `parsers` is the live dict (plugins add to it)."""

    def __init__(self, kind: str, plugin_flag: str) -> None:
        self.kind = kind
        self.plugin_flag = plugin_flag
        self.parsers: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator registering the class under `name`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")

        def decorate(cls: T) -> T:
            self.parsers[name] = cls
            return cls

        return decorate

    def get(self, name: str) -> T:
        """The class registered as `name`; ValueError naming the known ones otherwise."""
        try:
            return self.parsers[name]
        except KeyError:
            known = ", ".join(sorted(self.parsers)) or "(none)"
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {known} "
                f"(a plugin can register more, see {self.plugin_flag})"
            ) from None

    def import_plugin(self, path: str) -> None:
        """Imports a `.py` file or a module name so that its decorators run."""
        if path.endswith(".py") or os.path.isfile(path):
            _import_file(path, self.kind)
            return
        try:
            importlib.import_module(path)
        except ModuleNotFoundError as e:
            raise ValueError(f"{self.kind} plugin {path!r}: no such file or module ({e})") from e


def _import_file(path: str, kind: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{kind} plugin {path!r}: no such file")
    full = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(full))[0]
    # A unique module name per file: two plugins called `parsers.py` do not collide.
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    name = f"_jaxengine_plugin_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ValueError(f"{kind} plugin {path!r}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
