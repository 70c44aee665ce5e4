"""Data-parallel replicas on other nodes, as the head's API server sees them.

With ``--data-parallel-size N --data-parallel-size-local L`` (L < N) the head runs
ranks 0..L-1 itself and the other ranks run on ``--headless`` nodes
(`entrypoints.dp_node`). Each node connects to the head's ``--data-parallel-address``
and ``--data-parallel-rpc-port`` (`DPHead` listens there) and registers its ranks.
For each remote rank the head's `DPAsyncLLM` holds a `RemoteReplica`: the interface
of an `AsyncLLM` (``generate``, ``abort``, ``num_requests``, ``check_health``,
``errored``, ``shutdown``) over the node's connection.

The wire is a `multiprocessing.connection` socket, authenticated (HMAC challenge)
with ``$JAXENGINE_DP_AUTHKEY`` when set, else `DEFAULT_AUTHKEY`; every node must use
the same key. Messages are pickles (cloudpickle for ``logits_processors``), so the
port must only be reachable from trusted hosts: a peer that knows the key can run
code on the other side, and the default key is no secret.

    node -> head: ("register", NodeInfo); then ("batch", [item, ...]) where an item is
                  ("out", rank, RequestOutput) | ("error", rank, request_id, exception)
                  | ("stats", rank, SchedulerStats, IterationStats) | ("dead", rank, why)
    head -> node: ("ready",) or ("refused", why); then ("add", rank, request_id,
                  PreparedPrompt, priority) | ("abort", rank, [request_id]) | ("close",)

A remote replica's outputs reach the request's asyncio queue through a reader
thread and ``loop.call_soon_threadsafe``, as `AsyncLLM`'s engine thread delivers
them; its stats go to its stat loggers (``engine="rank"`` in `/metrics`). An error
while generating fails that request only. A node that disconnects makes its replicas
dead: their streams get `EngineDeadError`, `check_health` raises it (``/health`` 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from jaxengine.engine.llm_engine import PreparedPrompt
from jaxengine.engine.multihost import dumps
from jaxengine.entrypoints.async_llm import (
    EngineDeadError,
    StatLogger,
    Stream,
    call_soon,
    putter,
)
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "JAXENGINE_DP_AUTHKEY"
DEFAULT_AUTHKEY = b"jaxengine-data-parallel"
WAIT_TIMEOUT_ENV = "JAXENGINE_DP_WAIT_TIMEOUT"
DEFAULT_WAIT_TIMEOUT = 600.0
"""Seconds the head waits for the remote ranks (and a node for the head)."""


def authkey() -> bytes:
    """The key both ends authenticate with: ``$JAXENGINE_DP_AUTHKEY`` or the default."""
    key = os.environ.get(AUTHKEY_ENV)
    return key.encode() if key else DEFAULT_AUTHKEY


def wait_timeout() -> float:
    """``$JAXENGINE_DP_WAIT_TIMEOUT`` seconds, default `DEFAULT_WAIT_TIMEOUT`."""
    return float(os.environ.get(WAIT_TIMEOUT_ENV, DEFAULT_WAIT_TIMEOUT))


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a headless node tells the head when it registers."""

    ranks: tuple[int, ...]
    data_parallel_size: int
    max_model_len: int
    vocab_size: int
    host: str


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(dumps(message))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError naming it (it crosses the wire)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(error).__name__}: {error}")


class RemoteReplica:
    """Data-parallel rank ``rank`` on another node, with `AsyncLLM`'s interface."""

    def __init__(self, node: RemoteNode, rank: int) -> None:
        self.node = node
        self.rank = rank
        self.stat_loggers: list[StatLogger] = []
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _dead
        self._dead: BaseException | None = None

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def num_requests(self) -> int:
        """Requests in flight on this replica, as the head counts them."""
        with self._lock:
            return len(self._streams)

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when the replica failed or its node went away."""
        if self._dead is not None:
            raise self._dead

    async def generate(
        self,
        prompt: PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs from the node; closing early aborts it there.

        ``prompt`` is prepared on the head (`DPAsyncLLM.prepare`). Raises the error
        the node reported for this request, or `EngineDeadError`.
        """
        if not isinstance(prompt, PreparedPrompt):
            raise TypeError("a remote replica takes prompts prepared on the head")
        stream = self._open(request_id)
        finished = False
        try:
            self.node.send(("add", self.rank, request_id, prompt, priority))
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
            if not finished and self._dead is None:
                self.node.send_quietly(("abort", self.rank, [request_id]))

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests on the node (their streams end here at once)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._close(rid)
        if self._dead is None:
            self.node.send_quietly(("abort", self.rank, ids))

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Tells the node to stop (once for all its replicas)."""
        self.node.close()

    def _open(self, request_id: str) -> Stream:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            stream = Stream(asyncio.get_running_loop())
            self._streams[request_id] = stream
        return stream

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ reader thread

    def target(self, request_id: str, item: Any) -> tuple[Stream, Any] | None:
        """(stream, item) for a delivery to ``request_id``; None when nobody listens."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and isinstance(item, BaseException):
                del self._streams[request_id]
        return None if stream is None else (stream, item)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the reader
                logger.exception("stat logger %r failed", stat_logger)

    def fail(self, why: str) -> None:
        """Marks the replica dead; every open stream gets `EngineDeadError`."""
        dead = EngineDeadError(f"data parallel rank {self.rank} stopped: {why}")
        with self._lock:
            if self._dead is not None:
                return
            self._dead = dead
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            call_soon(stream.loop, putter(stream.queue, dead))


class RemoteNode:
    """The head's connection to one headless node, and that node's replicas."""

    def __init__(self, conn: Connection, info: NodeInfo) -> None:
        self.conn = conn
        self.info = info
        self.replicas = {rank: RemoteReplica(self, rank) for rank in info.ranks}
        self._send_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(
            target=self._read, name=f"jaxengine-dp-node-{info.ranks[0]}", daemon=True
        )
        self._thread.start()

    def send(self, message: Any) -> None:
        """Sends a message; raises `EngineDeadError` when the node is gone."""
        data = dumps(message)  # ValueError for what cannot be pickled: that request's fault
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError) as e:
            self._lost(f"sending to {self.info.host} failed: {e!r}")
            raise EngineDeadError(f"data parallel node {self.info.host} is gone") from e

    def send_quietly(self, message: Any) -> None:
        try:
            self.send(message)
        except (EngineDeadError, ValueError):
            pass

    def close(self) -> None:
        """Tells the node to stop and closes the connection (idempotent)."""
        if self._closing:
            return
        self._closing = True
        try:
            with self._send_lock:
                self.conn.send_bytes(dumps(("close",)))
        except (OSError, ValueError):
            pass
        self._thread.join(5.0)  # the node closes its end once it has stopped: EOF here
        self.conn.close()

    def _read(self) -> None:
        try:
            while True:
                kind, items = recv(self.conn)
                if kind != "batch":
                    raise ValueError(f"unknown message from the node: {kind!r}")
                self._dispatch(items)
        except (EOFError, OSError) as e:
            if not self._closing:
                self._lost(f"the node at {self.info.host} disconnected ({e!r})")
        except Exception as e:  # noqa: BLE001 - a broken message ends the node
            logger.exception("bad message from data parallel node %s", self.info.host)
            self._lost(f"bad message from the node: {e!r}")

    def _dispatch(self, items: list[tuple]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        for item in items:
            kind, rank = item[0], item[1]
            replica = self.replicas[rank]
            delivery = None
            if kind == "out":
                delivery = replica.target(item[2].request_id, item[2])
            elif kind == "error":
                delivery = replica.target(item[2], item[3])
            elif kind == "stats":
                replica.record(item[2], item[3])
            elif kind == "dead":
                logger.error("data parallel rank %d failed: %s", rank, item[2])
                replica.fail(item[2])
            if delivery is not None:
                stream, payload = delivery
                by_loop.setdefault(stream.loop, []).append(putter(stream.queue, payload))
        for loop, puts in by_loop.items():
            call_soon(loop, lambda puts=puts: [put() for put in puts])

    def _lost(self, why: str) -> None:
        if not self._closing:
            logger.error("data parallel ranks %s are lost: %s", list(self.replicas), why)
        for replica in self.replicas.values():
            replica.fail(why)
