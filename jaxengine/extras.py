"""Optional dependencies: PyTorch, and the one error a path that needs it raises.

Serving needs no torch: the JAX engine, the server, and a GGUF file's config and
tokenizer (`loader.gguf_config`) run without it. What does need it is installed with
the ``torch`` extra, ``pip install 'jaxengine[torch]'``:

- the torch fallback (``--model-impl transformers``, or ``auto`` for an architecture
  with no JAX port: `torch_fallback`);
- the config or tokenizer of a GGUF file whose architecture `loader.gguf_config` does
  not build itself (transformers' own GGUF reader imports torch);
- the latency benchmark's roofline (it counts the parameters on a meta-device model).

Each of them calls `require_torch` before importing torch, so a missing torch is one
``ImportError`` naming the extra. Nothing here imports torch: whether it is installed
is asked of the import system (``importlib.util.find_spec``), as transformers asks.
"""

from __future__ import annotations

import importlib.util

TORCH_INSTALL = "pip install 'jaxengine[torch]'"
"""How to install what `require_torch` asks for."""


def has_torch() -> bool:
    """Whether torch can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        return False


def require_torch(what: str) -> None:
    """Raises ``ImportError("<what> needs PyTorch: pip install 'jaxengine[torch]'")``
    unless torch can be imported."""
    if not has_torch():
        raise ImportError(f"{what} needs PyTorch: {TORCH_INSTALL}")
