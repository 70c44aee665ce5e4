"""A headless data-parallel node: replicas that serve the head's API server.

    jaxengine serve MODEL --headless --data-parallel-size 4 --data-parallel-size-local 2 \\
        --data-parallel-start-rank 2 --data-parallel-address HEAD --data-parallel-rpc-port P

`run_dp_node` builds this node's ``--data-parallel-size-local`` replicas (a
`DataParallelEngine` over the local devices: ranks ``start .. start + local - 1``),
each stepped by its own `AsyncLLM` thread (all sharing one `StreamTable`, owner: the
rank), then connects to the head (retrying until it listens, at most
``$JAXENGINE_DP_WAIT_TIMEOUT`` seconds), registers its ranks (`Register`, with its
`PROTOCOL_VERSION`) and serves what the head sends (`entrypoints.dp_remote` has the
protocol) until the head says close or goes away; then it exits 0.

Each request the head adds (`AddRequest`) runs as an asyncio task iterating the
replica's `AsyncLLM.generate`; its outputs, an error that ends it, and every step's
stats go back through the `Outbox` (`Output`, `RequestError`, `Stats`, `Dead`),
whose thread sends them in `Batch`es. An abort from the head cancels the task, which
aborts the request in its engine.

When the head says close, the requests still running are aborted and their last
outputs (finish reason ``abort``) reach the head before the node closes. SIGTERM or
SIGINT drains the node (``--shutdown-timeout``, as the API server: `NodeServer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from jaxengine.core.sched_output import SchedulerStats
from jaxengine.engine_args import EngineArgs
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.client import EngineDrainingError
from jaxengine.entrypoints.dp_remote import authkey, portable_error, recv, send, wait_timeout
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
    Ready,
    Refused,
    Register,
    RequestError,
    Stats,
)
from jaxengine.metrics.stats import IterationStats

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 30.0
"""After an abort, how long the requests get to send their last outputs (the abort
waits for the step in progress, which may be compiling a bucket)."""
POLL_S = 0.1


class Outbox:
    """Messages to the head, sent in batches by one thread (never from the loop)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[BatchItem | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxengine-dp-outbox", daemon=True)
        self._thread.start()

    def put(self, item: BatchItem) -> None:
        self._queue.put(item)

    def stats_logger(self, rank: int) -> _StatsForwarder:
        """A stat logger for rank ``rank``'s `AsyncLLM` that forwards to the head."""
        return _StatsForwarder(self, rank)

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [item for item in batch if item is not None]
            if items:
                try:
                    send(self.conn, Batch(tuple(items)))
                except OSError as e:
                    logger.warning("could not send to the head: %r", e)
                    return
            if len(items) < len(batch):
                return


class _StatsForwarder:
    def __init__(self, outbox: Outbox, rank: int) -> None:
        self.outbox = outbox
        self.rank = rank

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.outbox.put(Stats(self.rank, scheduler_stats, iteration_stats))


class NodeServer:
    """Runs the head's requests on this node's replicas (one event loop).

    It stops when the head says close or goes away: the requests still running are
    aborted, and their last outputs (finish reason ``abort``) go to the head first.
    On SIGTERM or SIGINT it drains as the API server does (`server/api_server/drain.py`): new
    requests are refused (`EngineDrainingError`, a 503 on the head), those running get
    up to ``shutdown_timeout`` seconds, the rest are aborted, then the node stops (the
    head sees its ranks gone); a second signal stops at once.
    """

    def __init__(
        self,
        conn: Connection,
        replicas: dict[int, AsyncLLM],
        outbox: Outbox,
        shutdown_timeout: float = 0.0,
    ) -> None:
        self.conn = conn
        self.replicas = replicas
        self.outbox = outbox
        self.shutdown_timeout = shutdown_timeout
        self._tasks: dict[str, asyncio.Task] = {}
        self._reported_dead: set[int] = set()
        self._draining = False
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Serves until the head says close, the connection ends or a drain ends."""
        loop = asyncio.get_running_loop()
        reader = threading.Thread(
            target=self._read, args=(loop, self._stop), name="jaxengine-dp-reader", daemon=True
        )
        reader.start()
        with _signal_handlers(loop, self._on_signal):
            await self._stop.wait()
            await self._abort_running()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._draining:
            logger.warning("%s during the drain: stopping now", name)
            for task in self._tasks.values():
                task.cancel()
            self._stop.set()
            return
        logger.info(
            "%s: draining; %d requests get up to %gs (--shutdown-timeout)",
            name, len(self._tasks), self.shutdown_timeout,
        )  # fmt: skip
        self._draining = True
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self._wait_tasks(self.shutdown_timeout)
        self._stop.set()

    async def _abort_running(self) -> None:
        """Aborts what still runs (each stream's last output, finished with reason
        ``abort``, goes to the head), waits for those outputs, then cancels the rest."""
        if self._tasks:
            logger.warning("aborting the %d requests still running", len(self._tasks))
            for replica in self.replicas.values():
                with contextlib.suppress(Exception):  # a dead replica's streams have ended
                    await replica.abort_all()
            await self._wait_tasks(ABORT_GRACE_S)
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _wait_tasks(self, timeout: float) -> bool:
        """True once no request runs here, False when ``timeout`` passes first."""
        end = time.monotonic() + timeout
        while self._tasks and time.monotonic() < end:
            await asyncio.sleep(min(POLL_S, max(end - time.monotonic(), 0.0)))
        return not self._tasks

    def _read(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        try:
            while True:
                message = recv(self.conn)
                if isinstance(message, Close):
                    logger.info("the head closed; stopping")
                    break
                loop.call_soon_threadsafe(self._handle, message)
        except (EOFError, OSError) as e:
            logger.warning("the head went away (%r); stopping", e)
        loop.call_soon_threadsafe(stop.set)

    def _handle(self, message: object) -> None:
        match message:
            case AddRequest(rank=rank, request_id=request_id):
                if self._draining:
                    error = EngineDrainingError(f"data parallel rank {rank} is shutting down")
                    self.outbox.put(RequestError(rank, request_id, error))
                    return
                if request_id in self._tasks:
                    error = ValueError(f"duplicate request id {request_id!r}")
                    self.outbox.put(RequestError(rank, request_id, error))
                    return
                coro = self._generate(rank, request_id, message.prompt, message.priority)
                self._tasks[request_id] = asyncio.get_running_loop().create_task(coro)
            case AbortRequests(request_ids=request_ids):
                for request_id in request_ids:
                    task = self._tasks.pop(request_id, None)
                    if task is not None:
                        task.cancel()  # leaving generate() aborts the request in its engine
            case _:
                logger.error("unexpected message from the head: %r", message)

    async def _generate(
        self, rank: int, request_id: str, prepared: PreparedPrompt, priority: int
    ) -> None:
        replica = self.replicas.get(rank)
        try:
            if replica is None:
                raise ValueError(f"this node has no data parallel rank {rank}")
            stream = replica.generate(prepared, prepared.params, request_id, priority=priority)
            async for out in stream:
                self.outbox.put(Output(rank, out))
        except asyncio.CancelledError:
            pass  # aborted by the head
        except Exception as e:  # noqa: BLE001 - fails this request only, on the head
            self.outbox.put(RequestError(rank, request_id, portable_error(e)))
            if replica is not None and replica.errored and rank not in self._reported_dead:
                self._reported_dead.add(rank)
                self.outbox.put(Dead(rank, f"its engine failed: {e!r}"))
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]


@contextlib.contextmanager
def _signal_handlers(
    loop: asyncio.AbstractEventLoop, handler: Callable[[int], None]
) -> Iterator[None]:
    """``handler(sig)`` on ``loop`` for SIGINT and SIGTERM (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig in SIGNALS:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)


def connect_to_head(address: tuple[str, int], timeout: float) -> Connection:
    """A connection to the head's listener, retried until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=authkey())
        except AuthenticationError as e:
            raise RuntimeError(
                f"the data parallel head at {address[0]}:{address[1]} refused this node's "
                "key: set the same $JAXENGINE_DP_AUTHKEY on every node"
            ) from e
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no data parallel head at {address[0]}:{address[1]} after {timeout:.0f}s "
                    f"({e!r}); is the head started with the same --data-parallel-address "
                    "and --data-parallel-rpc-port?"
                ) from e
            time.sleep(1.0)


def register(conn: Connection, info: NodeInfo) -> str | None:
    """Registers this node's ranks with the head: None once it answers `Ready`, else
    why it refused (or that it closed the connection)."""
    send(conn, Register(info))
    try:
        reply = recv(conn)
    except EOFError:
        return "the head closed the connection"
    if isinstance(reply, Ready):
        return None
    if isinstance(reply, Refused):
        return reply.reason
    return f"unexpected reply {type(reply).__name__}"


def run_dp_node(engine_args: EngineArgs, shutdown_timeout: float = 0.0) -> int:
    """`jaxengine serve --headless` with ``--data-parallel-address``: builds this node's
    replicas, registers them with the head and serves them until the head stops, or
    until a signal's drain (``--shutdown-timeout``: `NodeServer`) ends."""

    from jaxengine.entrypoints.factory import build_engine, engine_config

    config = engine_config(engine_args)
    parallel = config.parallel_config
    start, local = parallel.data_parallel_rank_start, parallel.local_data_parallel_size
    if start == 0:
        raise ValueError(
            "a --headless data parallel node holds ranks after the head's: set "
            "--data-parallel-start-rank (>= 1) and --data-parallel-size-local"
        )
    ranks = tuple(range(start, start + local))
    engine = build_engine(config, allow_remote=True)  # a DataParallelEngine: ranks > 1
    try:
        conn = connect_to_head(parallel.data_parallel_rpc_address, wait_timeout())
        info = NodeInfo(
            ranks, parallel.data_parallel_size, engine.max_model_len, engine.vocab_size,
            socket.gethostname(),
        )  # fmt: skip
        refusal = register(conn, info)
        if refusal is not None:
            logger.error("the head refused data parallel ranks %s: %s", list(ranks), refusal)
            return 1
        logger.info("serving data parallel ranks %s for the head", list(ranks))
        _serve(conn, dict(zip(ranks, engine.replicas, strict=True)), shutdown_timeout)
    finally:
        engine.shutdown()
    return 0


def _serve(conn: Connection, engines: dict[int, AsyncLLM], shutdown_timeout: float) -> None:
    outbox = Outbox(conn)
    streams = StreamTable()  # one table for the node's replicas, owner: the rank
    replicas = {
        rank: AsyncLLM(
            e.config,
            engine=e,
            stat_loggers=[outbox.stats_logger(rank)],
            thread_name=f"jaxengine-engine-{rank}",
            rank=rank,
            streams=streams,
        )
        for rank, e in engines.items()
    }
    try:
        asyncio.run(NodeServer(conn, replicas, outbox, shutdown_timeout).run())
    finally:
        for replica in replicas.values():
            replica.shutdown(shutdown_engine=False)
        outbox.close()
        conn.close()
