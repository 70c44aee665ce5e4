"""Running Python code in a child process where torch cannot be found.

The child sees the machine as if torch were not installed: every import finder is
wrapped so that ``torch`` and its submodules have no spec, so ``import torch`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("torch")`` is None (what
transformers' ``is_torch_available()`` asks), and ``importlib.metadata`` finds no
torch distribution by name. The preamble runs before anything else is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HIDE_TORCH = '''
import sys as _sys


class _HideTorch:
    """Finds what the wrapped finder finds, except torch."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def find_distributions(self, context=None):
        find = getattr(self.finder, "find_distributions", None)
        if find is None or (context is not None and context.name == "torch"):
            return iter(())
        return find() if context is None else find(context)

    def invalidate_caches(self):
        invalidate = getattr(self.finder, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()


_sys.meta_path[:] = [_HideTorch(f) for f in _sys.meta_path]
'''

TORCH_LOADED = "sorted(m for m in sys.modules if m.partition('.')[0] == 'torch')"
"""An expression: the torch modules the child has imported (``sys`` imported)."""


def run_without_torch(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Runs ``code`` (after `HIDE_TORCH`) in a fresh interpreter; ``env`` adds to the
    environment. Fails the test with the child's output unless it exits with 0."""
    result = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + "\n" + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, f"child failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def last_json_line(result: subprocess.CompletedProcess):
    """The child's last stdout line, parsed as JSON (what it reports back)."""
    return json.loads(result.stdout.strip().splitlines()[-1])
