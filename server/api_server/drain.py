"""Graceful drain: what `jaxengine serve` does on SIGTERM or SIGINT.

The first signal starts the drain (`Drain.start`):

1. New HTTP requests are refused with 503, a ``Retry-After`` header and OpenAI's error
   JSON (Anthropic's on its /v1/messages routes); ``/health`` is refused the same way,
   so a load balancer stops routing here (`DrainMiddleware`).
2. The requests already in flight run on for up to ``--shutdown-timeout`` seconds.
3. Whatever is left is aborted in the engine (`EngineClient.abort_all`): each stream
   ends with a final chunk whose finish reason is ``abort`` and ``data: [DONE]``, a
   non-streamed request gets its partial output with finish reason ``abort``. The
   connections are never cut while an answer is on its way.
4. uvicorn is told to exit; `server/api_server/launch.py` then shuts the engine down and
   `jaxengine serve` exits with status 0.

A second signal stops at once: uvicorn's forced exit (open answers are cut).

uvicorn's own signal handling would stop the listener and start its own (short)
graceful timeout at the first signal, so `DrainingServer` replaces it with ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Generator
from typing import Any

import uvicorn

from server.errors import error_response
from server.messages.errors import anthropic_error_response, is_messages_path

logger = logging.getLogger("jaxengine.server")

SHUTDOWN_TIMEOUT = 0.0
"""vLLM's default ``--shutdown-timeout``: requests still in flight are aborted at once."""
ABORT_GRACE_S = 30.0
"""After the abort, how long the handlers get to send their final chunks. The abort
applies between two steps, so the step in progress ends first: one that compiles a
bucket in the background takes seconds to tens of seconds on a CPU."""
POLL_S = 0.25
"""How often the drain re-checks the requests in flight (and re-sends the abort)."""
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InFlight:
    """HTTP requests being answered, counted by `DrainMiddleware` (event loop only)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight, False when ``timeout`` passes first."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
        except TimeoutError:
            return self.count == 0
        return True


class Drain:
    """The drain of one server: its state, read by `DrainMiddleware`, and its run.

    ``engine`` is the `EngineClient` (its ``abort_all``); ``server`` the uvicorn
    server to stop once drained; ``timeout`` is ``--shutdown-timeout``.
    """

    def __init__(self, engine: Any, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        if timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {timeout}")
        self.engine = engine
        self.timeout = timeout
        self.in_flight = InFlight()
        self.server: uvicorn.Server | None = None
        self.deadline: float | None = None  # time.monotonic() when the drain aborts
        self._task: asyncio.Task | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: until this server has drained (at
        least 1), when a replacement may be up; a balancer routes it elsewhere sooner."""
        left = 0.0 if self.deadline is None else self.deadline - time.monotonic()
        return max(1, math.ceil(left))

    def on_signal(self, sig: int) -> None:
        """A SIGTERM or SIGINT (on the event loop): starts the drain, or at the second
        one stops at once."""
        name = signal.Signals(sig).name
        if self.draining:
            logger.warning("%s during the drain: stopping now", name)
            if self.server is not None:
                self.server.force_exit = True
                self.server.should_exit = True
            return
        logger.info(
            "%s: draining (new requests get 503); %d requests in flight get up to %gs "
            "(--shutdown-timeout) before they are aborted",
            name, self.in_flight.count, self.timeout,
        )  # fmt: skip
        self.deadline = time.monotonic() + self.timeout
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        """Waits for the requests in flight, aborts the rest, then stops uvicorn."""
        try:
            if not await self.in_flight.wait_idle(self.deadline - time.monotonic()):
                logger.warning(
                    "--shutdown-timeout (%gs) passed: aborting the %d requests still in flight",
                    self.timeout, self.in_flight.count,
                )  # fmt: skip
                await self._abort_until_idle(ABORT_GRACE_S)
            logger.info("drained; shutting down")
        finally:
            if self.server is not None:
                self.server.should_exit = True

    async def _abort_until_idle(self, grace: float) -> None:
        """Aborts every engine request, again each poll (a request that had not reached
        the engine at the first abort), until nothing is in flight or ``grace`` passes."""
        end = time.monotonic() + grace
        while True:
            try:
                await self.engine.abort_all()
            except Exception:  # noqa: BLE001 - a dead engine: its streams already ended
                logger.exception("aborting the requests in flight failed")
            if await self.in_flight.wait_idle(min(POLL_S, end - time.monotonic())):
                return
            if time.monotonic() >= end:
                logger.error("%d requests did not end after the abort", self.in_flight.count)
                return


class DrainMiddleware:
    """Counts the HTTP requests in flight; while draining, refuses new ones with 503
    (OpenAI's error JSON, Anthropic's on /v1/messages, and ``Retry-After``). Pure ASGI,
    outermost, so a refused request costs nothing else."""

    def __init__(self, app, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        drain = self.drain
        if drain.draining:
            message = "the server is shutting down; retry the request on another replica"
            path = scope["path"].removeprefix(scope.get("root_path", "") or "")
            response = (
                anthropic_error_response(message, 503)
                if is_messages_path(path)
                else error_response(message, 503)
            )
            response.headers["Retry-After"] = str(drain.retry_after())
            return await response(scope, receive, send)
        drain.in_flight.enter()
        try:
            return await self.app(scope, receive, send)
        finally:
            drain.in_flight.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with `Drain`'s signal handling instead of its own."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        drain.server = self

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """SIGINT and SIGTERM call `Drain.on_signal` on the event loop while serving;
        the previous handlers come back afterwards (uvicorn's hook, overridden)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.drain.on_signal, sig)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
