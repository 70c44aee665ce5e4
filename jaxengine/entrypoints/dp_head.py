"""`DPHead`: where the headless data-parallel nodes find the head, and register.

The head opens the listener before it builds its own replicas, so the nodes (which
build theirs at the same time) can register as soon as they are ready. A node sends
`Register` (its `NodeInfo` and protocol version); another `PROTOCOL_VERSION`, ranks
that are not the head's to give out (out of range, the head's own, or already taken)
or a different ``--data-parallel-size`` are refused at once (`Refused` says why).
`wait` then blocks until every remote rank has registered (at most
``$JAXENGINE_DP_WAIT_TIMEOUT`` seconds), checks that the nodes serve the same model
limits as the head (``max_model_len``, vocabulary), answers `Ready`, and hands back
every node's `RemoteReplica`s, whose streams live in the table it is given. Nodes
that connect later are not taken: the listener closes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

from jaxengine.config.parallel import ParallelConfig
from jaxengine.entrypoints.dp_remote import (
    WAIT_TIMEOUT_ENV,
    RemoteNode,
    RemoteReplica,
    authkey,
    recv,
    send,
    wait_timeout,
)
from jaxengine.entrypoints.streams import StreamTable
from jaxengine.messages import NodeInfo, Ready, Refused, Register, check_version

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT = 30.0  # seconds a connected node has to send its NodeInfo


class DPRegistrationError(RuntimeError):
    """The remote data-parallel ranks did not all register, or do not fit the head."""


class DPHead:
    """The head's listener on ``--data-parallel-address``:``--data-parallel-rpc-port``."""

    def __init__(self, parallel: ParallelConfig) -> None:
        self.parallel = parallel
        self.address = parallel.data_parallel_rpc_address
        self.expected = set(range(parallel.local_data_parallel_size, parallel.data_parallel_size))
        self._listener = Listener(self.address, authkey=authkey())
        self._cond = threading.Condition()
        self._registered: list[tuple[Connection, NodeInfo]] = []
        self._claimed: set[int] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_all, name="jaxengine-dp-head")
        self._thread.daemon = True
        self._thread.start()
        logger.info(
            "waiting for data parallel ranks %s at %s:%d", sorted(self.expected), *self.address
        )

    def wait(
        self,
        max_model_len: int,
        vocab_size: int,
        timeout: float | None = None,
        *,
        streams: StreamTable | None = None,
    ) -> list[RemoteReplica]:
        """The remote replicas, by rank, once every remote rank has registered.

        Their streams live in ``streams`` (the `DPAsyncLLM`'s shared table; a new one
        by default). Raises `DPRegistrationError` after ``timeout`` seconds (default
        ``$JAXENGINE_DP_WAIT_TIMEOUT``) or when a node's model limits differ.
        """
        timeout = wait_timeout() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.expected <= self._claimed and time.monotonic() < deadline:
                self._cond.wait(min(deadline - time.monotonic(), 5.0))
            missing = None if self.expected <= self._claimed else self._missing_message(timeout)
            registered, self._registered = self._registered, []
        self.close()
        if missing is not None:
            for conn, _ in registered:
                _refuse(conn, "the head gave up waiting for the other data parallel ranks")
            raise DPRegistrationError(missing)
        self._check_models(registered, max_model_len, vocab_size)
        streams = streams if streams is not None else StreamTable()
        nodes = []
        for conn, info in registered:
            send(conn, Ready())
            nodes.append(RemoteNode(conn, info, streams))
        replicas = [r for node in nodes for r in node.replicas.values()]
        return sorted(replicas, key=lambda r: r.rank)

    def _check_models(
        self, registered: list[tuple[Connection, NodeInfo]], max_model_len: int, vocab_size: int
    ) -> None:
        """Refuses every node and raises unless all serve the head's model limits."""
        problems = [
            f"ranks {list(info.ranks)} on {info.host} have max_model_len "
            f"{info.max_model_len} and vocabulary {info.vocab_size}"
            for _, info in registered
            if (info.max_model_len, info.vocab_size) != (max_model_len, vocab_size)
        ]
        if problems:
            message = (
                f"the data parallel nodes must serve the head's model (max_model_len "
                f"{max_model_len}, vocabulary {vocab_size}): " + "; ".join(problems)
            )
            for conn, _ in registered:
                _refuse(conn, message)
            raise DPRegistrationError(message)

    def close(self) -> None:
        """Stops listening; connections not yet handed out by `wait` are closed."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._registered = self._registered, []
        for conn, _ in pending:
            _refuse(conn, "the head is stopping")
        try:  # wake the accept() of the listening thread, which then closes the listener
            socket.create_connection(self.address, timeout=1.0).close()
        except OSError:
            pass
        self._thread.join(5.0)

    def _missing_message(self, timeout: float) -> str:
        missing = sorted(self.expected - self._claimed)
        size = self.parallel.data_parallel_size
        host, port = self.address
        return (
            f"data parallel ranks {missing} did not register at {host}:{port} within "
            f"{timeout:.0f}s (${WAIT_TIMEOUT_ENV}): start them with `jaxengine serve MODEL "
            f"--headless --data-parallel-size {size} --data-parallel-size-local L "
            f"--data-parallel-start-rank {missing[0]} --data-parallel-address {host} "
            f"--data-parallel-rpc-port {port}` on the other nodes"
        )

    # ------------------------------------------------------------------ listening thread

    def _accept_all(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._closed or self.expected <= self._claimed:
                        return
                try:
                    conn = self._listener.accept()
                except (OSError, EOFError, AuthenticationError) as e:
                    with self._cond:
                        if self._closed:
                            return
                    logger.warning("a connection to the data parallel port failed: %r", e)
                    continue
                self._register(conn)
        finally:
            self._listener.close()

    def _register(self, conn: Connection) -> None:
        try:
            if not conn.poll(REGISTER_TIMEOUT):
                raise TimeoutError(f"nothing sent in {REGISTER_TIMEOUT:.0f}s")
            message = recv(conn)
            if not isinstance(message, Register):
                raise ValueError(f"expected a registration, got {type(message).__name__}")
        except Exception as e:  # noqa: BLE001 - a bad peer must not stop the head
            logger.warning("a data parallel node failed to register: %r", e)
            conn.close()
            return
        info = message.info
        try:
            check_version(message.version, f"the data parallel node at {info.host}")
        except RuntimeError as e:
            logger.error("refused data parallel node %s: %s", info.host, e)
            _refuse(conn, str(e))
            return
        with self._cond:
            problem = self._check(info)
            if problem is None:
                self._claimed.update(info.ranks)
                self._registered.append((conn, info))
                self._cond.notify_all()
        if problem is not None:
            logger.error("refused data parallel node %s: %s", info.host, problem)
            _refuse(conn, problem)
            return
        logger.info("data parallel ranks %s registered from %s", list(info.ranks), info.host)

    def _check(self, info: NodeInfo) -> str | None:
        size = self.parallel.data_parallel_size
        if info.data_parallel_size != size:
            return f"its --data-parallel-size is {info.data_parallel_size}, the head's {size}"
        ranks = set(info.ranks)
        if not ranks <= self.expected:
            return (
                f"ranks {sorted(ranks - self.expected)} are not remote ranks (the head "
                f"waits for {sorted(self.expected)})"
            )
        if ranks & self._claimed:
            return f"ranks {sorted(ranks & self._claimed)} are already registered"
        return None


def _refuse(conn: Connection, reason: str) -> None:
    try:
        send(conn, Refused(reason))
    except (OSError, ValueError):
        pass
    conn.close()
