"""Warm-up: one runner's compile jobs, each run once, before serving or beside it.

A job compiles one thing a step can need (a bucket's step, a sampler variant at a
request count). `CompileJobs` runs them

- **blocking** (`run_all`): every job in the caller's thread, in order; or
- **in the background** (`start`): a daemon thread runs them in order while the
  engine already serves. A step that needs a job first calls `ensure(key)`: it runs
  the job itself if nobody has started it, or waits for the thread that is running
  it. So the first request is answered after the few compilations it needs, not
  after all of them.

`on_done` runs once every job has finished (the runner arms its compile guard there).
A failed job re-raises in whoever `ensure`s it; the thread logs it and goes on.
No JAX here: jobs are plain callables.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

from tqdm import tqdm

logger = logging.getLogger(__name__)

Job = tuple[Hashable, Callable[[], None]]


class CompileJobs:
    """Named compile jobs, each run at most once, by whichever thread gets it first."""

    def __init__(
        self,
        jobs: Sequence[Job],
        *,
        on_done: Callable[[], None] = lambda: None,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """``context()`` wraps every job run by the background thread (the runner's
        compile-guard watch)."""
        self._order = [key for key, _ in jobs]
        self._jobs = dict(jobs)
        self._done: dict[Hashable, threading.Event] = {}
        self._errors: dict[Hashable, BaseException] = {}
        self._lock = threading.Lock()
        self._on_done = on_done
        self._context = context
        self._closed = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ running

    def run_all(self, progress: bool = False) -> None:
        """Runs every job in this thread, in order, then ``on_done``."""
        for key in tqdm(self._order, desc="Compiling buckets", disable=not progress, unit="fn"):
            self.ensure(key)
        self._finish()

    def start(self) -> None:
        """Runs the jobs in a background thread; returns at once."""
        self._thread = threading.Thread(target=self._work, name="jaxengine-compile", daemon=True)
        self._thread.start()

    def ensure(self, key: Hashable) -> None:
        """Returns once job ``key`` has run (running it here if nobody has started
        it). Unknown keys return at once: nothing to compile ahead for them."""
        with self._lock:
            event = self._done.get(key)
            mine = event is None and key in self._jobs
            if mine:
                event = self._done[key] = threading.Event()
        if event is None:
            return
        if mine:
            try:
                self._jobs[key]()
            except BaseException as exc:
                self._errors[key] = exc
                raise
            finally:
                event.set()
        else:
            event.wait()
            if key in self._errors:
                raise self._errors[key]

    @property
    def finished(self) -> bool:
        """True once every job has run (or the jobs were closed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every job has run; False on timeout."""
        return self._finished.wait(timeout)

    def close(self) -> None:
        """Stops the background thread after its current job and waits for it."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._finished.set()

    # ------------------------------------------------------------------ thread

    def _work(self) -> None:
        with self._context():
            for key in self._order:
                if self._closed.is_set():
                    return
                with _logged(key):
                    self.ensure(key)
        if not self._closed.is_set():
            self._finish()

    def _finish(self) -> None:
        if not self._finished.is_set():
            self._on_done()
            self._finished.set()


@contextlib.contextmanager
def _logged(key: Hashable) -> Iterator[None]:
    try:
        yield
    except Exception:
        logger.exception("background compilation of %s failed", key)
