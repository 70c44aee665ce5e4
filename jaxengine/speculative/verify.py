"""Verification: which of a request's proposals the target's step keeps.

A request with ``m`` proposals runs ``m + 1`` logits rows in the target's step, the
row after each proposal sampled with the proposals before it among its outputs and
the request's key for that position (`runner.sampling_metadata.SamplingRow`). The
runner reads the sampled ids back and keeps what `accept` returns.

Each row's token is drawn from the target's distribution at that position, so with
proposals decided before the draw (one-hot proposal distributions: the n-gram,
draft-model and EAGLE proposers are all greedy) keeping the proposals while each
equals the token drawn before it, then one more drawn token, is the standard
accept/resample rule: accept ``d`` with probability ``p(d)``; on rejection the
token drawn is ``p`` conditioned on not ``d``. The tokens are exactly those sampling
without proposals gives: acceptance changes how many come per step, not which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def accept(drafts: Sequence[int], drawn: Callable[[int], int]) -> list[int]:
    """The tokens a request gets from a step that verified ``drafts``: ``drawn(j)``
    is the token sampled at its ``j``-th logits row (after ``j`` proposals). At least
    one token, at most ``len(drafts) + 1``."""
    tokens = [drawn(0)]
    while len(tokens) <= len(drafts) and tokens[-1] == drafts[len(tokens) - 1]:
        tokens.append(drawn(len(tokens)))
    return tokens
