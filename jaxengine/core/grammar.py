"""What the scheduler needs from structured outputs (`GrammarTracker`), as a Protocol.

The implementation is `jaxengine.structured_output.StructuredOutputManager`; the
scheduler only holds this interface (and works without one), so `core/` stays free of
grammar libraries and of jax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class GrammarTracker(Protocol):
    def is_ready(self, request: Any) -> bool:
        """Whether a waiting request may be admitted (its grammar is compiled, or it has
        none). Raises ValueError when its grammar cannot be compiled."""
        ...

    def bitmask(
        self, requests: Sequence[Any], drafts: Mapping[str, Sequence[int]] | None = None
    ) -> tuple[tuple[str, ...], Any]:
        """(ids, int32 rows [n, ceil(V/32)]) for the constrained requests among those
        that sample this step; ((), None) when none is. A request with ``drafts``
        (speculative decoding) has one row more per proposal: the mask after it."""
        ...

    def check_drafts(self, request: Any, drafts: Sequence[int]) -> tuple[int, ...]:
        """The proposals cut at the first one the request's grammar does not allow
        (none while its grammar waits for the end of reasoning)."""
        ...

    def accept(self, request: Any, token_ids: Sequence[int]) -> None:
        """The request's newly sampled tokens (already appended to it)."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished or was aborted."""
        ...
