"""Incremental detokenization: the text each new batch of sampled tokens adds.

Decoding each token on its own is wrong (byte-level tokens can hold part of a UTF-8
character; SentencePiece tokens drop their leading space out of context), and
re-decoding the whole output every step costs O(length) per token. Like vLLM, this
keeps two offsets into the token list:

    ids:  [ ... | prefix_offset ... read_offset | new tokens ]
                  \\__ already emitted, decoded again as context __/

Each update decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``
(a window of a few tokens) and emits what the second adds to the first. Text is held
back (nothing emitted, offsets unchanged) while it may still change:

- the window's text ends in U+FFFD: a multi-byte character is still incomplete, and
  comes out whole once its last byte arrives;
- the last token is a SentencePiece byte-fallback token (``<0xE4>``): the decoder
  turns each run of such tokens into its UTF-8 text only if the *whole run* is valid,
  else into one U+FFFD per byte, so one more byte token can change the text of the
  run. Holding until the run closes also keeps windows from starting inside a run.
  Special tokens that decoding skips are transparent here, as they are to the decoder.

The window starts on the prompt's last tokens, so the first output token is decoded
in context; the text is otherwise what ``tokenizer.decode(output_ids)`` gives.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded as context for the first output tokens
# Per tokenizer: (byte-fallback token ids, ids of special tokens decoding can skip).
_TOKEN_SETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_sets(tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    try:
        return _TOKEN_SETS[tokenizer]
    except (KeyError, TypeError):
        pass
    byte_ids: set[int] = set()
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        names = [f"<0x{b:02X}>" for b in range(256)]
        for name, i in zip(names, tokenizer.convert_tokens_to_ids(names), strict=True):
            if i is not None and tokenizer.convert_ids_to_tokens(i) == name:
                byte_ids.add(i)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, tok in added.items() if getattr(tok, "special", False)}
    sets = (frozenset(byte_ids), frozenset(special))
    try:
        _TOKEN_SETS[tokenizer] = sets
    except TypeError:  # not weak-referenceable: compute again next time
        pass
    return sets


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    Invariant: after ``update(..., final=True)`` (or ``flush()``), ``output_text`` and
    the concatenation of all returned deltas equal
    ``tokenizer.decode(output_token_ids, skip_special_tokens=...)`` for tokenizers whose
    decoding is local (byte-level BPE; SentencePiece with byte fallback and no strip of
    the first leading space). Each update costs O(tokens in the window), not O(output).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._byte_ids, special = _token_sets(tokenizer)
        self._transparent = special if skip_special_tokens else frozenset()
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
        while context and context[0] in self._byte_ids:
            context.pop(0)  # the context must not start inside a byte run
        if context and (self._run_open(context) or self._decode(context).endswith(_REPLACEMENT)):
            context = []  # the prompt ends inside a character: no context
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._n_context = len(context)
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        """All output token ids given so far."""
        return self._ids[self._n_context :]

    def update(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Adds sampled tokens; returns the text they complete (possibly "").

        With ``final`` the held-back tail (an incomplete character, which the full
        decode renders as U+FFFD) is emitted too: pass it with the last tokens.
        """
        self._ids.extend(int(t) for t in new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        unsettled = new_text.endswith(_REPLACEMENT) or self._run_open(self._ids)
        if len(new_text) <= len(prefix_text) or (unsettled and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emits any held-back tail; call once the request has finished."""
        return self.update((), final=True)

    def _run_open(self, ids: list[int]) -> bool:
        """Whether ``ids`` ends in a byte-fallback run (skipped specials ignored)."""
        if not self._byte_ids:
            return False
        for i in reversed(ids):
            if i not in self._transparent:
                return i in self._byte_ids
        return False

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
