"""N-gram proposals (prompt lookup): draft tokens from the request's own tokens.

The longest suffix of the request's tokens, between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long, that also occurs earlier in them: the tokens that
followed its latest earlier occurrence (the latest one followed by a full proposal,
if any) are the proposal. Numpy only, on the host;
the target model verifies the proposal in its next step (`speculative.verify`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxengine.speculative import ProposalInput


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` ids that followed the latest earlier occurrence of the longest
    suffix n-gram (``min_n <= n <= max_n``), or [] when none occurs."""
    ids = np.asarray(tokens, np.int64)
    last = len(ids) - 1
    if last < min_n or k <= 0:
        return []
    ends = np.flatnonzero(ids[:last] == ids[last])  # earlier positions of the last id
    if ends.size == 0:
        return []
    length = np.ones(ends.size, np.int64)  # match length ending at each candidate
    for j in range(1, min(max_n, last)):
        back = ends - j
        ok = (length == j) & (back >= 0)
        ok[ok] = ids[back[ok]] == ids[last - j]
        length += ok
    best = int(length.max())
    if best < min_n:
        return []
    matches = ends[length == best]
    whole = matches[matches + k <= last]  # followed by k ids at least
    end = int(whole[-1] if whole.size else matches[0])
    return ids[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """Proposes for the requests of a step (`ModelRunner`); keeps nothing between
    steps."""

    def __init__(self, k: int, min_n: int, max_n: int, disable_by_batch_size: int | None) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.disable_by_batch_size = disable_by_batch_size

    def propose(
        self, inputs: Sequence[ProposalInput], features: Any = None, ensure: Any = None
    ) -> list[list[int]]:
        """Nothing is proposed while the step holds ``disable_by_batch_size``
        requests or more."""
        limit = self.disable_by_batch_size
        if limit is not None and len(inputs) >= limit:
            return [[] for _ in inputs]
        return [
            propose_ngram(x.token_ids, self.min_n, self.max_n, self.k) if x.propose else []
            for x in inputs
        ]

    def forget(self, req_ids: Iterable[str]) -> None:
        pass

    def compile_jobs(self) -> list:
        return []

    def release(self) -> None:
        pass
