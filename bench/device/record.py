"""The run's record: sections of items, each with a time budget, saved as they finish.

`Recorder` holds the JSON document ``{"run": ..., "<section>": {"<item>": ...}}`` and
writes it to disk after every item, so a run that the machine's time limit kills
still leaves everything measured up to then. A section runs its items in order
within a budget of seconds (`Section.item`): an item that raises records
``{"error": ...}`` and the section goes on; once the budget is spent, the item
running is interrupted (a ``SIGALRM`` raises `OutOfTime` in the main thread at the
next Python instruction: a compilation inside XLA finishes first) and the items left
record ``{"skipped": "out of time"}``. Either way the run goes on to the next section.
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxengine.benchmarks.common import log


class OutOfTime(BaseException):
    """A section's budget ran out. A BaseException, so that no ``except Exception``
    inside the engine (a fallback, a retry) swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raises `OutOfTime` in the main thread once ``seconds`` have passed (no limit
    off the main thread or without ``SIGALRM``: the deadline checks still apply)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise OutOfTime(f"the section's budget ran out after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars, tuples and paths turned into JSON types."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalar
        return value.item()
    return str(value)


class Recorder:
    """The run's JSON document, written to ``path`` after every item."""

    def __init__(self, path: Path, run_info: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"run": run_info}
        self.save()

    def save(self) -> None:
        partial = self.path.with_suffix(self.path.suffix + ".tmp")
        partial.write_text(json.dumps(jsonable(self.doc), indent=2) + "\n")
        partial.replace(self.path)  # atomic: a killed run leaves a whole file

    def section(self, name: str, budget_s: float) -> Section:
        self.doc[name] = {}
        return Section(self, name, budget_s)


class Section:
    """One section's items, run within ``budget_s`` seconds from its creation."""

    def __init__(self, recorder: Recorder, name: str, budget_s: float) -> None:
        self.recorder = recorder
        self.name = name
        self.budget_s = budget_s
        self.start = time.perf_counter()
        self.results: dict[str, Any] = recorder.doc[name]

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def item(self, name: str, fn: Callable[[], Any]) -> Any:
        """Runs ``fn()`` within the section's remaining time and records its result
        (a dict) under ``name``; returns it, or None when it failed or was skipped."""
        left = self.remaining()
        result = None
        if left <= 0:
            self.results[name] = {"skipped": "out of time"}
        else:
            log(f"{self.name} / {name} ({left:.0f} s left)")
            began = time.perf_counter()
            try:
                with time_limit(left):
                    result = fn()
                self.results[name] = result
            except OutOfTime as exc:
                self.results[name] = {"error": f"out of time: {exc}"}
                gc.collect()  # a failed engine's device buffers go before the next one
            except Exception as exc:  # noqa: BLE001 - one item's failure ends only that item
                traceback.print_exc()
                self.results[name] = {"error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
                gc.collect()
            seconds = self.results.setdefault("item_seconds", {})
            seconds[name] = round(time.perf_counter() - began, 2)
        self.recorder.save()
        return result
