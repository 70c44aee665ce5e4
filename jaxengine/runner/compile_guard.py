"""Counting XLA compilations, to prove that none happens after warm-up.

JAX reports every backend compilation (and every persistent-cache hit; both counted
per thread for `compile_counts`) through `jax.monitoring`, on the thread that
compiles; one listener per process hands each event to the guard watching that
thread. A runner watches while it warms up and while it runs a step
(``with guard.watching():``), so its guard counts its own engine's compilations and
nobody else's: a second engine built in the same process, or a data-parallel replica
stepping on another thread, never shows up in this one's count.

The runner arms the guard when warm-up ends; a compilation after that is logged as a
warning and counted in ``compiles_after_warmup`` (the recompile test asserts it does
not grow under varied traffic). ``close()`` disarms it for good.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import jax

logger = logging.getLogger(__name__)

_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_watching = threading.local()  # .guard: the CompileGuard this thread compiles for
_counts = threading.local()  # .compiles, .hits: backend compilations, cache hits
_install_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs: object) -> None:
    if event != _BACKEND_EVENT:
        return
    _counts.compiles = getattr(_counts, "compiles", 0) + 1
    guard = getattr(_watching, "guard", None)
    if guard is not None:
        guard.count(duration)


def _on_cache_hit(event: str, **kwargs: object) -> None:
    if event == _CACHE_HIT_EVENT:
        _counts.hits = getattr(_counts, "hits", 0) + 1


def _install_listener() -> None:
    """(Re-)registers this module's two listeners. Other code may clear every
    listener of the process (`jax.monitoring.clear_event_listeners`, which Tunix's
    metrics logger calls on close), so each call removes ours if present and adds
    them again rather than trusting an earlier registration."""
    pairs = (
        (jax.monitoring.unregister_event_duration_listener,
         jax.monitoring.register_event_duration_secs_listener, _on_event),
        (jax.monitoring.unregister_event_listener,
         jax.monitoring.register_event_listener, _on_cache_hit),
    )  # fmt: skip
    with _install_lock:
        for unregister, register, listener in pairs:
            try:
                unregister(listener)
            except (AssertionError, ValueError):  # not registered (any more)
                pass
            register(listener)


def compile_counts() -> tuple[int, int]:
    """(backend compilations, of which answered by JAX's persistent cache) on this
    thread so far. Compare before and after a ``compile()`` to know whether XLA really
    compiled: a persistent-cache hit counts in both, and JAX's in-memory cache (the
    same lowered module compiled again) in neither."""
    _install_listener()
    return getattr(_counts, "compiles", 0), getattr(_counts, "hits", 0)


class CompileGuard:
    """Counts the backend compilations of one engine; ``arm()`` starts the
    after-warm-up count."""

    def __init__(self) -> None:
        self.total = 0
        self.armed = False
        self.closed = False
        self.compiles_after_warmup = 0
        _install_listener()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Attributes this thread's compilations to this guard until the block ends
        (its listeners registered again first: something may have cleared them)."""
        _install_listener()
        previous = getattr(_watching, "guard", None)
        _watching.guard = self
        try:
            yield
        finally:
            _watching.guard = previous

    def count(self, duration: float) -> None:
        if self.closed:
            return
        self.total += 1
        if self.armed:
            self.compiles_after_warmup += 1
            logger.warning(
                "XLA compilation after warm-up (%.2fs): a shape escaped the buckets", duration
            )

    def arm(self) -> None:
        self.armed = not self.closed

    def close(self) -> None:
        """Disarms the guard for good (its engine is shut down)."""
        self.closed = True
        self.armed = False
