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

The table also knows the load admission control weighs (`Load`,
`entrypoints.admission`): each stream's sequences (its ``n``) and prompt length, and
how many of its sequences are still in the prefill phase (no output token yet). The
engine side reports the sequences that got their first token (`prefilled`, from
`IterationStats.prefilled_request_ids`), whatever the request's output kind.

Invariants (all under one lock, so a producer and a caller never race):
- a request id is open at most once: `open` raises ValueError for a duplicate;
- an error (an exception delivered, or `fail_all`) ends its stream: the stream
  leaves the table when the error is queued, and is the last item it gets;
- after ``fail_all(error, owner)`` no stream of that owner (of any, for
  ``owner=None``) stays open, and `open` for it raises ``error``; so a caller
  either gets a stream that will be failed, or the error, never a stream that
  hangs;
- a delivery for a request that is not open (closed, aborted, or reopened by
  another owner) is dropped;
- `load` is the sum over the open streams: their sequences, and the prompt tokens of
  their sequences still prefilling; a stream that leaves the table takes its share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jaxengine.outputs import RequestOutput

Item = RequestOutput | BaseException
"""What a stream carries: an output, or the error that ends the request."""


@dataclasses.dataclass(frozen=True)
class Load:
    """What the open streams hold, as admission control weighs it."""

    num_seqs: int = 0
    """Sequences in flight (waiting or running): a request with ``n`` counts n."""
    num_prefill_tokens: int = 0
    """Prompt tokens of the sequences with no output token yet (queued or
    prefilling), a request's prompt once per such sequence."""


class Stream:
    """One request's outputs, read on the caller's event loop (`next`)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, owner: int, seqs: int = 1, prompt_tokens: int = 0
    ) -> None:
        self.loop = loop
        self.owner = owner
        self.seqs = seqs
        self.prompt_tokens = prompt_tokens
        self.prefilling = seqs
        """Its sequences with no output token yet (`StreamTable.prefilled`)."""
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
        self._seqs = 0  # `Load`'s totals over the open streams
        self._prefill_tokens = 0

    def open(
        self, request_id: str, owner: int = 0, *, seqs: int = 1, prompt_tokens: int = 0
    ) -> Stream:
        """A new stream for ``request_id`` on the running event loop, run by ``owner``:
        a request of ``seqs`` sequences (its ``n``) on a prompt of ``prompt_tokens``.

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
            stream = self._streams[request_id] = Stream(loop, owner, seqs, prompt_tokens)
            self._seqs += seqs
            self._prefill_tokens += seqs * prompt_tokens
        return stream

    def close(self, request_id: str) -> None:
        """Forgets the stream (idempotent); later deliveries to it are dropped."""
        with self._lock:
            self._pop(request_id)

    def _pop(self, request_id: str) -> Stream | None:
        """Removes a stream and its share of the load (the caller holds the lock)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._seqs -= stream.seqs
            self._prefill_tokens -= stream.prefilling * stream.prompt_tokens
        return stream

    def prefilled(self, request_ids: Iterable[str], owner: int | None = None) -> None:
        """One sequence of each listed request (of ``owner``; any, for None) got its
        first token: it leaves the prefill phase. An id appears once per sequence;
        ids not open (or past their sequences) are ignored."""
        with self._lock:
            for request_id in request_ids:
                stream = self._streams.get(request_id)
                if stream is None or stream.prefilling == 0:
                    continue
                if owner is None or stream.owner == owner:
                    stream.prefilling -= 1
                    self._prefill_tokens -= stream.prompt_tokens

    def load(self) -> Load:
        """The open streams' `Load` (all owners)."""
        with self._lock:
            return Load(self._seqs, self._prefill_tokens)

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
                    self._pop(request_id)
                targets.append((stream, item))
        _send(targets)

    def fail_all(self, error: BaseException, owner: int | None = None) -> None:
        """Ends every open stream of ``owner`` (of all owners for None) with ``error``,
        and makes `open` raise it for that owner from now on."""
        with self._lock:
            self._failed[owner] = error
            ids = [rid for rid, s in self._streams.items() if owner in (None, s.owner)]
            targets = [(self._pop(rid), error) for rid in ids]
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
