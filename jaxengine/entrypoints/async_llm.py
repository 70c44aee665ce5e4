"""`AsyncLLM`: the engine behind the server, stepped on its own thread.

The event loop never runs a model step. It validates a prompt (`LLMEngine.prepare`,
raising `ValueError` before anything is queued), hands the request to the engine
thread through a command queue, and reads the request's outputs from an
`asyncio.Queue` that the engine thread fills with `loop.call_soon_threadsafe`.

    async for out in engine.generate(prompt, params, request_id):
        ...

Leaving the loop early (a client that disconnects cancels the task iterating it)
aborts the request: the engine thread frees its pages before its next step.

When a step raises, the engine is dead: every waiting stream receives an
`EngineDeadError`, new requests are refused with it, and `check_health()` raises it
(the server's `/health` answers 503). Nothing hangs.

After each step the thread hands `SchedulerStats` and `IterationStats` to the stat
loggers (`jaxengine.metrics`), which are thread-safe.

With ``--data-parallel-size N`` the server runs one `AsyncLLM` per replica behind a
`DPAsyncLLM` (`entrypoints.dp_async_llm`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine, PreparedPrompt
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StatLogger = Any
"""An object with ``record(scheduler_stats, iteration_stats)``."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; the server must be restarted."""


class Stream:
    """Where one request's outputs go: a queue read on the caller's event loop
    (filled from other threads with `call_soon` and `putter`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncLLM:
    """An `LLMEngine` stepped on a background thread, with async per-request streams."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        stat_loggers: Sequence[StatLogger] = (),
        engine: LLMEngine | None = None,
        thread_name: str = "jaxengine-engine",
    ) -> None:
        self.engine = engine if engine is not None else LLMEngine(config)
        self.config = self.engine.config
        self.stat_loggers = list(stat_loggers)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _dead
        self._dead: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> Any:
        """An `AsyncLLM`, or a `DPAsyncLLM` when ``data_parallel_size`` > 1 (both with
        the interface the server uses)."""
        import jax

        config = engine_args.create_engine_config(platform=jax.default_backend())
        if config.parallel_config.data_parallel_size > 1:
            from jaxengine.entrypoints.dp_async_llm import DPAsyncLLM

            return DPAsyncLLM(config, **kwargs)
        return cls(config, **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def num_requests(self) -> int:
        """Requests in flight (queued or running), as the API server counts them."""
        with self._lock:
            return len(self._streams)

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when the engine thread has stopped."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    # ------------------------------------------------------------------ requests

    def prepare(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """Tokenizes and validates (raises ValueError, nothing queued)."""
        return self.engine.prepare(prompt, params)

    async def generate(
        self,
        prompt: Any | PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (by its ``output_kind``) until it finishes.

        ``prompt`` is a text, token ids, a dict, or a `PreparedPrompt` already
        validated by `prepare`. Raises ValueError for bad input (before queueing) and
        `EngineDeadError` when the engine fails. Closing the iterator early aborts.
        """
        prepared = prompt if isinstance(prompt, PreparedPrompt) else None
        if prepared is None:
            prepared = self.prepare(prompt, sampling_params)
        stream = self._open(request_id)
        self._commands.put(("add", (request_id, prepared, priority, time.time())))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._close(request_id)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests (any state); their pages are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._close(rid)
            self._commands.put(("abort", rid))

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stops the engine thread and (unless told not to) releases the engine."""
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if shutdown_engine:
            self.engine.shutdown()

    def _open(self, request_id: str) -> Stream:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            stream = Stream(asyncio.get_running_loop())
            self._streams[request_id] = stream
        return stream

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped.is_set():
                busy = engine.has_unfinished_requests()
                if not self._apply_commands(block=not busy):
                    return
                if not engine.has_unfinished_requests():
                    self._record(engine.take_iteration_stats())  # aborts, if any
                    continue
                outputs = engine.step()
                self._deliver(outputs)
                self._record(engine.take_iteration_stats())
        except BaseException as e:  # noqa: BLE001 - reported to every client
            logger.exception("engine step failed; the engine is stopping")
            self._fail(e)

    def _apply_commands(self, block: bool) -> bool:
        """Applies queued adds and aborts; waits for one when ``block``. False = stop."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                self.engine.abort_request(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, prepared: PreparedPrompt, priority: int, arrival: float):
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:  # aborted before the engine saw it
            return
        try:
            self.engine.add_prepared(request_id, prepared, arrival_time=arrival, priority=priority)
        except ValueError as e:
            self._send(stream, e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        for stream, out in targets:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(putter(stream.queue, out))
        for loop, puts in by_loop.items():
            call_soon(loop, lambda puts=puts: [put() for put in puts])

    def _send(self, stream: Stream, item: RequestOutput | BaseException) -> None:
        call_soon(stream.loop, putter(stream.queue, item))

    def _record(self, iteration_stats: Any) -> None:
        if not self.stat_loggers:
            return
        stats = self.engine.get_stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, iteration_stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("stat logger %r failed", stat_logger)

    def _fail(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine stopped after an error: {error!r}")
        dead.__cause__ = error
        with self._lock:
            self._dead = error
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self._send(stream, dead)


def putter(q: asyncio.Queue, item: Any) -> Callable[[], None]:
    return lambda: q.put_nowait(item)


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass
