"""Speculative decoding, host side (no jax): the proposers that draft tokens for the
target model to verify in its next step (`ngram`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Drafts tokens for the requests of a step, after its tokens are sampled."""

    def propose(self, token_lists: Sequence[Sequence[int] | None]) -> list[list[int]]:
        """One proposal (possibly empty) per request: from its tokens (prompt and
        outputs so far), or none for None (a request that is not to propose)."""
        ...
