"""Scheduling policies as small objects: waiting-queue order, preemption victim, and the
partial-prefill limiter. The scheduler holds one of each and never branches on names.

- "fcfs": waiting served by arrival; preempted requests re-enter at the front; the
  victim is the most recently admitted running request.
- "priority": waiting served by (priority, arrival_time), lower first; the victim is the
  running request with the largest (priority, arrival_time).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from jaxengine.core.request import Request


class FCFSQueue:
    """Waiting queue in arrival order; `prepend` puts a request at the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Waiting queue ordered by (priority, arrival_time, insertion); `prepend` == `add`
    (a preempted request goes back to its rank, which its key already encodes)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*request.sort_key, next(self._seq), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


class FCFSPolicy:
    name = "fcfs"

    def make_queue(self) -> FCFSQueue:
        return FCFSQueue()

    def choose_victim(self, running: list[Request]) -> Request:
        """The request to preempt when blocks run out: the last admitted."""
        return running[-1]


class PriorityPolicy:
    name = "priority"

    def make_queue(self) -> PriorityQueue:
        return PriorityQueue()

    def choose_victim(self, running: list[Request]) -> Request:
        """The lowest-priority (largest value) running request, latest arrival on ties."""
        return max(running, key=lambda r: r.sort_key)


_POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def get_policy(name: str) -> FCFSPolicy | PriorityPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}") from None


@dataclass(frozen=True)
class PartialPrefillLimiter:
    """How many requests may be left part-way through their prefill at once.

    A request is *partial* after a step if more than one of its known tokens is still
    uncomputed (a decode waiting for its budget is not partial). It is *long* if that
    remainder exceeds `long_threshold` (> 0). A waiting request may be admitted with a
    chunk that leaves it partial only while fewer than `max_partial` requests are partial
    and, if long, fewer than `max_long` long ones are. Requests that finish their prefill
    within the step are never limited, so many short prompts still share one step.
    """

    max_partial: int = 1
    max_long: int = 1
    long_threshold: int = 0

    def is_long(self, remaining: int) -> bool:
        return 0 < self.long_threshold < remaining

    def allows(self, remaining: int, num_partial: int, num_long_partial: int) -> bool:
        if num_partial >= self.max_partial:
            return False
        return not (self.is_long(remaining) and num_long_partial >= self.max_long)
