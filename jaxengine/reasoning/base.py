"""The reasoning-parser interface: split what a model wrote into reasoning and content.

Two users:

* the engine (structured outputs) works on token ids: `is_reasoning_end(ids)` says
  whether the reasoning section has closed, `content_token_ids(ids)` gives the ids after
  it, which are the first ones the grammar sees;
* the server works on text: `extract(text)` for a whole output, `stream()` for a
  per-choice state whose `feed(delta)` returns (reasoning delta, content delta).

Every parser keeps one invariant: for any split of an output into deltas, the
concatenated stream deltas equal what `extract` returns for the whole (None as "").
A parser that cannot keep it for some input documents the exception.

Pure Python: no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxengine.reasoning.registry import ParserRegistry


class ReasoningStream:
    """Per-choice streaming state; `finish` flushes what was held back."""

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for newly generated text; either may be ""."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """Flushes anything held back (a partial marker, trailing newlines)."""
        raise NotImplementedError


class ReasoningParser:
    """Base class; subclasses are registered with `@register_reasoning_parser(name)`."""

    name: str = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def is_reasoning_end(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the reasoning section has ended within these ids."""
        raise NotImplementedError

    def content_token_ids(self, output_token_ids: Sequence[int]) -> list[int]:
        """The ids after the end of reasoning ([] while it has not ended)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; each None when absent or empty."""
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        """A fresh streaming state for one choice."""
        raise NotImplementedError


REGISTRY: ParserRegistry = ParserRegistry("reasoning parser", "--reasoning-parser-plugin")
register_reasoning_parser = REGISTRY.register
"""Class decorator: `@register_reasoning_parser("name")`."""


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker.

    That many characters must be held back: the next delta may complete the marker.
    """
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def vocab_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` if the tokenizer has it as one token, else None."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if vocab is not None:
        return vocab.get(token)
    tid = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if tid is None or (tid == unk and unk is not None) else int(tid)
