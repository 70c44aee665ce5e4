"""Counting XLA compilations, to prove that none happens after warm-up.

JAX reports every backend compilation through `jax.monitoring`; the guard listens
once per process and counts. The runner arms it when warm-up ends; a compilation
after that is logged as a warning and counted in ``compiles_after_warmup`` (the
recompile test asserts it does not grow under varied traffic). The events carry no
owner, so every guard hears every compilation in the process: one engine's warm-up
counts in another, already armed, engine's guard.
"""

from __future__ import annotations

import logging
import threading

import jax

logger = logging.getLogger(__name__)

_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileGuard:
    """Counts backend compilations; ``arm()`` starts the after-warm-up count."""

    _listening = False
    _lock = threading.Lock()
    _guards: list[CompileGuard] = []

    def __init__(self) -> None:
        self.total = 0
        self.armed = False
        self.compiles_after_warmup = 0
        with CompileGuard._lock:
            CompileGuard._guards.append(self)
            if not CompileGuard._listening:
                jax.monitoring.register_event_duration_secs_listener(CompileGuard._on_event)
                CompileGuard._listening = True

    @staticmethod
    def _on_event(event: str, duration: float, **kwargs) -> None:
        if event != _BACKEND_EVENT:
            return
        for guard in list(CompileGuard._guards):
            guard._count(duration)

    def _count(self, duration: float) -> None:
        self.total += 1
        if self.armed:
            self.compiles_after_warmup += 1
            logger.warning(
                "XLA compilation after warm-up (%.2fs): a shape escaped the buckets", duration
            )

    def arm(self) -> None:
        self.armed = True

    def close(self) -> None:
        with CompileGuard._lock:
            if self in CompileGuard._guards:
                CompileGuard._guards.remove(self)
