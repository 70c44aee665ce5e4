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
the same key. The messages are `jaxengine.messages`' dataclasses, pickled (cloudpickle
for ``logits_processors``), so the port must only be reachable from trusted hosts: a
peer that knows the key can run code on the other side, and the default key is no
secret.

    node -> head: Register(NodeInfo, version); then Batch(items), each item an
                  Output | RequestError | Stats | Dead of one rank
    head -> node: Ready() or Refused(reason); then AddRequest(rank, request_id,
                  PreparedPrompt, priority) | AbortRequests(rank, ids) | Close()

A remote replica's streams live in the `StreamTable` it shares with the head's
`DPAsyncLLM` (owner: its rank): the node's reader thread delivers each batch's outputs
into it, as `AsyncLLM`'s engine thread does; its stats go to its stat loggers
(``engine="rank"`` in `/metrics`). An error while generating fails that request
only. A node that disconnects makes its replicas dead: their streams get
`EngineDeadError`, `check_health` raises it (``/health`` 503).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from jaxengine.core.sched_output import SchedulerStats
from jaxengine.entrypoints.admission import num_seqs
from jaxengine.entrypoints.client import EngineDeadError, StatLogger
from jaxengine.entrypoints.streams import StreamTable
from jaxengine.inputs import PreparedPrompt
from jaxengine.messages import (
    AbortRequests,
    AddRequest,
    Batch,
    BatchItem,
    Close,
    Dead,
    NodeInfo,
    Output,
    RequestError,
    Stats,
    dumps,
    loads,
)
from jaxengine.metrics.stats import IterationStats
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


def send(conn: Connection, message: object) -> None:
    """Sends one `jaxengine.messages` message (ValueError if it cannot be pickled)."""
    conn.send_bytes(dumps(message))


def recv(conn: Connection) -> Any:
    """The next message from ``conn`` (EOFError when the peer closed it)."""
    return loads(conn.recv_bytes())


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError naming it (it crosses the wire)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(error).__name__}: {error}")


class RemoteReplica:
    """Data-parallel rank ``rank`` on another node: a `ReplicaClient`."""

    def __init__(self, node: RemoteNode, rank: int, streams: StreamTable) -> None:
        self.node = node
        self.rank = rank
        self.streams = streams
        self.stat_loggers: list[StatLogger] = []
        self._dead: BaseException | None = None
        self._fail_lock = threading.Lock()

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def num_requests(self) -> int:
        """Requests in flight on this replica, as the head counts them."""
        return self.streams.count(self.rank)

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when the replica failed or its node went away."""
        if self._dead is not None:
            raise self._dead.with_traceback(None)

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
        stream = self.streams.open(
            request_id,
            self.rank,
            seqs=num_seqs(prompt.params),
            prompt_tokens=len(prompt.token_ids),
        )
        try:
            self.node.send(AddRequest(self.rank, request_id, prompt, priority))
            while not stream.finished:
                yield await stream.next()
        finally:
            self.streams.close(request_id)
            if not stream.finished and self._dead is None:
                self.node.send_quietly(AbortRequests(self.rank, (request_id,)))

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests on the node (their streams end here at once)."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        for rid in ids:
            if self.streams.owner_of(rid) == self.rank:
                self.streams.close(rid)
        if self._dead is None:
            self.node.send_quietly(AbortRequests(self.rank, ids))

    async def abort_all(self) -> None:
        """Tells the node to stop (`shutdown`): it aborts its requests first, and
        their last outputs (finished with reason ``abort``) arrive before it closes.
        The head asks only when its server shuts down (`server/api_server/drain.py`)."""
        await asyncio.to_thread(self.node.close)

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Tells the node to stop (once for all its replicas)."""
        self.node.close()

    # ------------------------------------------------------------------ reader thread

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """A step's stats from the node: its first tokens to the table (admission
        control's prefill backlog), then the stat loggers."""
        self.streams.prefilled(iteration_stats.prefilled_request_ids, self.rank)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the reader
                logger.exception("stat logger %r failed", stat_logger)

    def fail(self, why: str) -> None:
        """Marks the replica dead; every open stream gets `EngineDeadError`."""
        with self._fail_lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(f"data parallel rank {self.rank} stopped: {why}")
        self.streams.fail_all(self._dead, self.rank)


class RemoteNode:
    """The head's connection to one headless node, and that node's replicas."""

    def __init__(self, conn: Connection, info: NodeInfo, streams: StreamTable) -> None:
        self.conn = conn
        self.info = info
        self.streams = streams
        self.replicas = {rank: RemoteReplica(self, rank, streams) for rank in info.ranks}
        self._send_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(
            target=self._read, name=f"jaxengine-dp-node-{info.ranks[0]}", daemon=True
        )
        self._thread.start()

    def send(self, message: object) -> None:
        """Sends a message; raises `EngineDeadError` when the node is gone."""
        data = dumps(message)  # ValueError for what cannot be pickled: that request's fault
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError) as e:
            self._lost(f"sending to {self.info.host} failed: {e!r}")
            raise EngineDeadError(f"data parallel node {self.info.host} is gone") from e

    def send_quietly(self, message: object) -> None:
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
                self.conn.send_bytes(dumps(Close()))
        except (OSError, ValueError):
            pass
        self._thread.join(5.0)  # the node closes its end once it has stopped: EOF here
        self.conn.close()
        self._lost("the node was closed")  # a stream still open ends (EngineDeadError)

    def _read(self) -> None:
        try:
            while True:
                message = recv(self.conn)
                if not isinstance(message, Batch):
                    raise ValueError(f"unexpected message from the node: {message!r}")
                self._dispatch(message.items)
        except (EOFError, OSError) as e:
            if not self._closing:
                self._lost(f"the node at {self.info.host} disconnected ({e!r})")
        except Exception as e:  # noqa: BLE001 - a broken message ends the node
            logger.exception("bad message from data parallel node %s", self.info.host)
            self._lost(f"bad message from the node: {e!r}")

    def _dispatch(self, items: Sequence[BatchItem]) -> None:
        """Delivers a batch's outputs and errors, rank by rank, in order (one callback
        per event loop and rank); records stats; fails ranks that died."""
        deliveries: dict[int, list[tuple[str, Any]]] = {}
        for item in items:
            replica = self.replicas[item.rank]
            match item:
                case Output(output=out):
                    deliveries.setdefault(item.rank, []).append((out.request_id, out))
                case RequestError(request_id=request_id, error=error):
                    deliveries.setdefault(item.rank, []).append((request_id, error))
                case Stats(scheduler_stats=sched, iteration_stats=iteration):
                    replica.record(sched, iteration)
                case Dead(reason=reason):
                    logger.error("data parallel rank %d failed: %s", item.rank, reason)
                    self.streams.deliver(deliveries.pop(item.rank, []), item.rank)
                    replica.fail(reason)
                case _:
                    raise ValueError(f"unexpected item from the node: {item!r}")
        for rank, batch in deliveries.items():
            self.streams.deliver(batch, rank)

    def _lost(self, why: str) -> None:
        if not self._closing:
            logger.error("data parallel ranks %s are lost: %s", list(self.replicas), why)
        for replica in self.replicas.values():
            replica.fail(why)
