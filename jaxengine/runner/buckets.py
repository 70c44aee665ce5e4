"""The finite set of step shapes (buckets) an engine compiles.

One dimension: the padded token count ``T``. The request dimension follows from it,
``R = min(T, max_num_seqs)``: every real request has at least one token, so a batch
of ``n`` tokens never has more than ``min(n, max_num_seqs)`` requests. Keeping one
dimension keeps the compile count at ``log2(max_num_batched_tokens)`` instead of a
product of two lists; the price is that a long prefill chunk computes logits for
``R`` rows (a few percent of its forward).

With speculative decoding each request may need logits (and a sampled token) at up
to ``1 + k`` positions, so the logits rows are ``L = min(T, max_num_seqs * (1 + k))``.
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A compiled step shape."""

    num_tokens: int
    num_reqs: int
    num_logits: int = 0
    """Rows of logits and samples (0: ``num_reqs``, one per request)."""

    def __post_init__(self) -> None:
        if not self.num_logits:
            object.__setattr__(self, "num_logits", self.num_reqs)


def default_token_buckets(max_num_batched_tokens: int, smallest: int = 1) -> list[int]:
    """Powers of two from ``smallest`` up to (and including) the token budget."""
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


class BucketSet:
    """Maps a batch's (tokens, requests) to the smallest compiled bucket holding it."""

    def __init__(
        self, token_buckets: list[int], max_num_seqs: int, logits_per_req: int = 1
    ) -> None:
        """``logits_per_req``: ``1 + num_speculative_tokens``."""
        if not token_buckets or sorted(set(token_buckets)) != list(token_buckets):
            raise ValueError(f"token buckets must be strictly increasing: {token_buckets}")
        self.token_buckets = list(token_buckets)
        self.max_num_seqs = max_num_seqs
        self.buckets = [
            Bucket(t, min(t, max_num_seqs), min(t, max_num_seqs * logits_per_req))
            for t in token_buckets
        ]

    def select(self, num_tokens: int, num_reqs: int) -> Bucket:
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.buckets) or num_reqs > self.buckets[i].num_reqs:
            raise ValueError(
                f"a step of {num_tokens} tokens and {num_reqs} requests exceeds the largest "
                f"bucket {self.buckets[-1]}"
            )
        return self.buckets[i]

    @property
    def request_sizes(self) -> list[int]:
        return sorted({b.num_reqs for b in self.buckets})

    @property
    def logits_sizes(self) -> list[int]:
        """The sampler's row counts."""
        return sorted({b.num_logits for b in self.buckets})
