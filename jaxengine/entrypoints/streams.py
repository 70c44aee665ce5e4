"""`StreamTable`: where every in-flight request's outputs go, for every engine client.

A request's caller reads its outputs from a `Stream`, an `asyncio.Queue` on the
caller's event loop. The producers run on other threads (an `AsyncLLM` engine
thread, a `RemoteNode` reader thread) and hand the table a batch at a time:
`deliver` looks every target up under one lock and makes one
``loop.call_soon_threadsafe`` per event loop per batch, however many requests it
holds.

Each stream has an owner, the data-parallel rank of the replica that runs it (0 for
a single engine). With data parallelism ONE table is shared by the `DPAsyncLLM`
front and all its replicas, local and remote, so the balancer's loads
(`count` per owner) and the replica that must abort a request (`owner_of`) come
from the same place as the streams themselves.

Invariants (all under one lock, so a producer and a caller never race):
- a request id is open at most once: `open` raises ValueError for a duplicate;
- an error (an exception delivered, or `fail_all`) ends its stream: the stream
  leaves the table when the error is queued, and is the last item it gets;
- after ``fail_all(error, owner)`` no stream of that owner (of any, for
  ``owner=None``) stays open, and `open` for it raises ``error``; so a caller
  either gets a stream that will be failed, or the error, never a stream that
  hangs;
- a delivery for a request that is not open (closed, aborted, or reopened by
  another owner) is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jaxengine.outputs import RequestOutput

Item = RequestOutput | BaseException
"""What a stream carries: an output, or the error that ends the request."""


class Stream:
    """One request's outputs, read on the caller's event loop (`next`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: int) -> None:
        self.loop = loop
        self.owner = owner
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.finished = False
        """Whether `next` has returned the request's finished output."""

    async def next(self) -> RequestOutput:
        """The next output; raises the error that ended the request, if one did."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        return item


class StreamTable:
    """Thread-safe map of request id -> `Stream`, with per-owner failure."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._failed: dict[int | None, BaseException] = {}  # owner (None: all) -> error

    def open(self, request_id: str, owner: int = 0) -> Stream:
        """A new stream for ``request_id`` on the running event loop, run by ``owner``.

        Raises ValueError for an id already open, and the owner's error after
        `fail_all`.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            error = self._failed.get(owner, self._failed.get(None))
            if error is not None:
                raise error.with_traceback(None)
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            stream = self._streams[request_id] = Stream(loop, owner)
        return stream

    def close(self, request_id: str) -> None:
        """Forgets the stream (idempotent); later deliveries to it are dropped."""
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, items: Iterable[tuple[str, Item]], owner: int | None = None) -> None:
        """Queues each ``(request_id, output or error)`` on its stream, one callback per
        event loop. Only streams of ``owner`` (any, for None) are served; an error ends
        its stream."""
        targets: list[tuple[Stream, Item]] = []
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None or (owner is not None and stream.owner != owner):
                    continue
                if isinstance(item, BaseException):
                    del self._streams[request_id]
                targets.append((stream, item))
        _send(targets)

    def fail_all(self, error: BaseException, owner: int | None = None) -> None:
        """Ends every open stream of ``owner`` (of all owners for None) with ``error``,
        and makes `open` raise it for that owner from now on."""
        with self._lock:
            self._failed[owner] = error
            ids = [rid for rid, s in self._streams.items() if owner in (None, s.owner)]
            targets = [(self._streams.pop(rid), error) for rid in ids]
        _send(targets)

    def count(self, owner: int | None = None) -> int:
        """Open streams of ``owner`` (all of them for None): the requests in flight."""
        with self._lock:
            if owner is None:
                return len(self._streams)
            return sum(1 for s in self._streams.values() if s.owner == owner)

    def counts(self) -> dict[int, int]:
        """Open streams per owner (owners with none are absent), counted in one pass."""
        counts: dict[int, int] = {}
        with self._lock:
            for stream in self._streams.values():
                counts[stream.owner] = counts.get(stream.owner, 0) + 1
        return counts

    def owner_of(self, request_id: str) -> int | None:
        """The owner of an open request (None when it is not open)."""
        with self._lock:
            stream = self._streams.get(request_id)
        return None if stream is None else stream.owner


def _send(targets: list[tuple[Stream, Item]]) -> None:
    """One ``call_soon_threadsafe`` per event loop, putting that loop's items in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]] = {}
    for stream, item in targets:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, puts in by_loop.items():
        _call_soon(loop, functools.partial(_put_all, puts))


def _put_all(puts: list[tuple[asyncio.Queue, Item]]) -> None:
    for q, item in puts:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass
