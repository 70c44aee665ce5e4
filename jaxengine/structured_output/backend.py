"""The interfaces between the manager and a grammar library.

A backend turns a request's `StructuredOutputsParams` into a grammar key (the text
the library compiles, which is also the cache key), checks it cheaply, and compiles it
into a `Grammar`: a matcher that tracks the tokens generated so far and writes the
allowed next tokens as bits into a row of an int32 bitmask (`bitmask_width(V)` words,
bit j of word w allows token 32 * w + j; llguidance's and xgrammar's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxengine.structured_params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(V / 32)."""
    return -(-vocab_size // 32)


class Grammar(Protocol):
    """One request's matcher state."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advances over sampled tokens; False (and an error state) if one is not allowed."""
        ...

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` ([W] int32)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens."""
        ...

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the first, may follow in turn (nothing is
        consumed): proposals of speculative decoding are cut there."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        ...

    def copy(self) -> Grammar:
        """A fresh, independent matcher in the same state."""
        ...


class GrammarBackend(Protocol):
    """A grammar library behind the manager."""

    name: str

    def grammar_key(self, params: StructuredOutputsParams) -> str:
        """The grammar text for `params` (ValueError if it cannot be expressed)."""
        ...

    def validate(self, key: str) -> None:
        """A cheap check of a grammar text; ValueError naming the problem."""
        ...

    def compile(self, key: str) -> Grammar:
        """A matcher for a validated grammar text (may be slow: run off the loop)."""
        ...

    def fill_bitmasks(self, grammars: Sequence[tuple[Grammar, int]], bitmask: np.ndarray) -> None:
        """Fills many rows at once (a backend may do it in parallel)."""
        ...
