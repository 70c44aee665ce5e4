"""How hard XLA optimizes what the tests compile.

Most engines a test builds (a golden condition, a parallel layout, a kernel check, a
server of one module) compile a handful of programs and run them for a few steps of a
tiny model: XLA's optimization passes cost more there than they save. So every test
process, and every process it starts, compiles with JAX's
``jax_disable_most_optimizations`` (``FLAG`` set to "1" by tests/conftest.py before
jax is imported, unless the environment sets it): a tiny engine's compilation 6.0 ->
3.7 s, its decoding about 1.5x slower. The same operations either way, rounded
differently: every check against a reference holds at either level, but an engine
compared token for token (logprobs included) with a shared engine is built at that
engine's level (`async_llm` of tests/engine/test_async_scheduling.py).

The engines many tests share decode enough tokens that full optimization pays for
itself: the session engines of tests/engine/conftest.py and the SmolLM2 engines of
tests/engine/test_quantization.py and test_rollout.py (built inside `optimized()`),
the shared servers of tests/server/conftest.py and the SmolLM2 server of
test_quantized_async.py (started with ``OPTIMIZED``).
tests/README.md has the measurements behind the split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FLAG = "JAX_DISABLE_MOST_OPTIMIZATIONS"
OPTIMIZED = {FLAG: "0"}
"""The environment of a shared server: XLA's full optimization."""


@contextlib.contextmanager
def optimized() -> Iterator[None]:
    """Programs compiled inside are fully optimized (an engine built inside keeps
    them). JAX's in-memory caches are cleared first: they would hand back a program
    this process compiled earlier at the minimal level (its persistent cache keys
    include the level)."""
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
