"""Stored responses (``store: true``): in memory, bounded, least recently used out.

Each `StoredResponse` keeps the Response object as last reported, the chat
conversation it continues (for ``previous_response_id``: the previous messages, its
input and its output, without its instructions), and a background response's task.
The store holds at most ``capacity`` responses (``--max-stored-responses``); adding
one more evicts the least recently used finished response, or, when every stored
response is still running, the least recently used one, whose task is cancelled
(its engine request aborted); the response just added stays. A capacity of 0 stores
nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

from server.responses.output import TERMINAL


@dataclasses.dataclass
class StoredResponse:
    """One stored response."""

    response: dict[str, Any]
    """The Response object, replaced as the response progresses."""
    conversation: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Chat messages up to and including the output (set once it is finished)."""
    task: asyncio.Task | None = None
    """A background response's run; None otherwise."""

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


class ResponseStore:
    """Response id -> `StoredResponse`, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        record = self._items.get(response_id)
        if record is not None:
            self._items.move_to_end(response_id)
        return record

    def put(self, record: StoredResponse) -> None:
        """Stores ``record`` under its response's id, evicting beyond the capacity."""
        if self.capacity == 0:
            return
        response_id = record.response["id"]
        self._items[response_id] = record
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._evict(keep=response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._items.pop(response_id, None)

    def _evict(self, keep: str) -> None:
        older = [(k, r) for k, r in self._items.items() if k != keep]
        victim = next((k for k, r in older if r.finished), None)
        if victim is None:
            victim = older[0][0] if older else keep
        record = self._items.pop(victim)
        if record.task is not None and not record.task.done():
            record.task.cancel()
