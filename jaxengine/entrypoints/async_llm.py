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

Each request's stream lives in a `StreamTable` (`entrypoints.streams`), owned by this
engine's ``rank``. With ``--data-parallel-size N`` the server runs one `AsyncLLM` per
replica behind a `DPAsyncLLM` (`entrypoints.dp_async_llm`), all sharing its table.

Admission control (``--max-num-queued-reqs``, ``--max-num-queued-tokens``:
`entrypoints.admission`) is the table owner's: an `AsyncLLM` with a table of its own
checks each request in `generate` before it is queued; one sharing a table (a
data-parallel replica, a headless node's rank) leaves it to the front that owns it.
After each step the thread tells the table which sequences got their first token
(they leave the prefill backlog).
`dp_async_llm.async_engine` builds whichever of the two a config needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.rollout import RPC_METHODS
from jaxengine.entrypoints.admission import AdmissionControl, num_seqs
from jaxengine.entrypoints.client import EngineDeadError, EngineFront, StatLogger
from jaxengine.entrypoints.pausing import PAUSE_MODES, PauseState
from jaxengine.entrypoints.streams import StreamTable
from jaxengine.inputs import PreparedPrompt
from jaxengine.metrics.stats import IterationStats
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]

logger = logging.getLogger(__name__)


class AsyncLLM(EngineFront):
    """An `LLMEngine` stepped on a background thread, with async per-request streams.

    Implements `EngineClient`, and `ReplicaClient` as data-parallel rank ``rank``:
    its streams are ``streams``'s with owner ``rank`` (a table of its own unless
    given one to share, as `DPAsyncLLM` and a headless node do). With a table of its
    own it checks the config's admission caps; a shared table's owner checks them.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        stat_loggers: Sequence[StatLogger] = (),
        engine: LLMEngine | None = None,
        thread_name: str = "jaxengine-engine",
        rank: int = 0,
        streams: StreamTable | None = None,
    ) -> None:
        self.engine = engine if engine is not None else LLMEngine(config)
        self.config = self.engine.config
        self.stat_loggers = list(stat_loggers)
        self.rank = rank
        own_table = streams is None  # its owner checks admission for all who share it
        self.streams = StreamTable() if streams is None else streams
        self.admission = AdmissionControl.of(self.config.scheduler_config) if own_table else None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._dead: BaseException | None = None
        self._pause = PauseState()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ properties

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def num_requests(self) -> int:
        """Requests in flight (queued or running), as the API server counts them."""
        return self.streams.count(self.rank)

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when the engine thread has stopped."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: Any | PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (by its ``output_kind``) until it finishes.

        ``prompt`` is a text, token ids, a dict, or a `PreparedPrompt` already
        validated by `prepare`. Raises ValueError for bad input (before queueing),
        `AdmissionRejectedError` over an admission cap, and `EngineDeadError` when the
        engine fails. Closing the iterator early aborts.
        """
        self.engine.rollout.check_awake()
        prepared = prompt if isinstance(prompt, PreparedPrompt) else None
        if prepared is None:
            prepared = self.prepare(prompt, sampling_params, lora_request)
        seqs = num_seqs(prepared.params)
        self.check_admission(seqs)
        stream = self.streams.open(
            request_id, self.rank, seqs=seqs, prompt_tokens=len(prepared.token_ids)
        )
        self._commands.put(_Add(request_id, prepared, priority, time.time()))
        try:
            while not stream.finished:
                yield await stream.next()
        finally:
            self.streams.close(request_id)
            if not stream.finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests (any state); their pages are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.streams.owner_of(rid) == self.rank:
                self.streams.close(rid)
            self._commands.put(_Abort(rid))

    async def abort_all(self) -> None:
        """Aborts every request in flight, between steps: each stream ends with a last
        output finished with reason ``abort`` (a non-streamed request's: its partial
        output), as ``pause_generation("abort")`` but without pausing. The server's
        drain calls it once ``--shutdown-timeout`` has passed (`server/api_server/drain.py`)."""
        await self._on_engine_thread(_Call(self._abort_all_now))

    def _abort_all_now(self) -> None:
        outputs = self.engine.abort_all()
        self.streams.deliver(((o.request_id, o) for o in outputs), self.rank)

    # ------------------------------------------------------------------ RL rollouts

    @property
    def is_sleeping(self) -> bool:
        return self.engine.rollout.is_sleeping()

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stops stepping (vLLM's modes): ``abort`` the unfinished requests (each
        stream ends with finish reason ``abort``), ``wait`` for them to finish, or
        ``keep`` them, held until `resume_generation`. New requests wait too."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        await self._on_engine_thread(_Pause(mode))

    async def resume_generation(self) -> None:
        await self._on_engine_thread(_Resume())

    async def is_paused(self) -> bool:
        return self._pause.paused

    async def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``engine.rollout.collective_rpc`` (sleep, wake_up, update_weights, ...:
        `engine.rollout.RPC_METHODS`) on the engine thread, between steps; one result
        per replica."""
        if method not in RPC_METHODS:
            raise ValueError(f"unknown method {method!r}; expected one of {', '.join(RPC_METHODS)}")
        rollout = self.engine.rollout
        return await self._on_engine_thread(
            _Call(lambda: rollout.collective_rpc(method, args, kwargs))
        )

    async def _on_engine_thread(self, command: _Pause | _Resume | _Call) -> Any:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        self._commands.put(command)
        return await asyncio.wrap_future(command.done)

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stops the engine thread and (unless told not to) releases the engine."""
        self._stopped.set()
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if shutdown_engine:
            self.engine.shutdown()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped.is_set():
                busy = engine.has_unfinished_requests() and not self._pause.paused
                if not self._apply_commands(block=not busy):
                    return
                self._pause.drained(engine)
                if self._pause.paused or not engine.has_unfinished_requests():
                    self._record(engine.take_iteration_stats())  # aborts, if any
                    continue
                outputs = engine.step()
                self.streams.deliver(((o.request_id, o) for o in outputs), self.rank)
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
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            else:
                self._control(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _control(self, command: _Pause | _Resume | _Call) -> None:
        """A pause, resume or rollout call, run here between steps; its result (or
        error) goes to the caller's future."""
        try:
            if isinstance(command, _Pause):
                if command.mode == "abort":
                    self._abort_all_now()
                self._pause.begin(command, self.engine)
                return  # ``wait``: answered once drained (`PauseState.drained`)
            if isinstance(command, _Resume):
                for add in self._pause.end(self.engine):
                    self._add(add)
                command.done.set_result(None)
                return
            result = command.fn()
            self._record(self.engine.take_iteration_stats())  # a new sleep state, say
            command.done.set_result(result)
        except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
            command.done.set_exception(e)

    def _add(self, add: _Add) -> None:
        if self.streams.owner_of(add.request_id) != self.rank:  # aborted before now
            return
        if self._pause.hold(add):
            return
        try:
            self.engine.add_prepared(
                add.request_id, add.prepared, arrival_time=add.arrival, priority=add.priority
            )
        except ValueError as e:
            self.streams.deliver([(add.request_id, e)], self.rank)

    def _record(self, iteration_stats: IterationStats) -> None:
        self.streams.prefilled(iteration_stats.prefilled_request_ids, self.rank)
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
        self._dead = error
        self.streams.fail_all(dead, self.rank)


# Commands from the event loop to the engine thread (they never leave this process).


@dataclasses.dataclass(frozen=True)
class _Add:
    request_id: str
    prepared: PreparedPrompt
    priority: int
    arrival: float


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


@dataclasses.dataclass(frozen=True)
class _Pause:
    mode: str
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class _Resume:
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


_Command = _Add | _Abort | _Stop | _Pause | _Resume | _Call
