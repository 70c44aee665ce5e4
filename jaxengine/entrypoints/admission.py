"""Admission control: vLLM's ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``.

The API server's engine front (`AsyncLLM` alone, or the `DPAsyncLLM` over its
replicas) checks each request when it arrives, before it reaches an engine, against
the `Load` of its `StreamTable` (the requests it has in flight), and refuses it with
`AdmissionRejectedError` (HTTP 503: a load balancer retries it elsewhere; nothing
else is affected):

- ``max_num_queued_reqs``: the sequences in flight (waiting or running, a request
  with ``n`` > 1 counting n) plus the new request's must not go over it;
- ``max_num_queued_tokens``: the prompt tokens of the sequences in the prefill phase
  (no output token yet) must be under it. As in vLLM, the new request's own prompt
  is not added: the check is on the backlog it would join.

The request cap is checked first; a refused request counts once, under the cap that
fired (`rejections`: vLLM's ``admission_rejections_total``, by ``reason``), however
many sequences it asked for. A cap of None is no cap; 0 refuses every request (as in
vLLM). With data parallelism the caps are the whole front's, all replicas together,
as vLLM's API server counts them before it routes a request to a rank. The offline
`LLM` applies neither (nor does vLLM's). Host side, no jax.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from jaxengine.entrypoints.streams import Load

if TYPE_CHECKING:
    from jaxengine.config import SchedulerConfig

REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
"""The ``reason`` label values: the name of the cap that refused the request."""

MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}
"""What the client reads (vLLM's wording), by reason."""


class AdmissionRejectedError(RuntimeError):
    """A request refused by admission control (the server answers 503); ``reason``
    names the cap (one of `REASONS`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(MESSAGES[reason])
        self.reason = reason

    def __reduce__(self) -> tuple:
        return type(self), (self.reason,)


def num_seqs(params: Any) -> int:
    """The sequences a request's parameters ask for: its ``n`` (1 for pooling)."""
    return getattr(params, "n", 1) or 1


class AdmissionControl:
    """The two caps and the count of requests they refused, by reason.

    `check` runs on the front's event loop, which is the only place a request is
    admitted, so a check and the open that follows it see no other admission in
    between; the engine threads only ever lower the load. The counts are read by
    the metrics from another thread, under a lock.
    """

    def __init__(
        self, max_num_queued_reqs: int | None = None, max_num_queued_tokens: int | None = None
    ) -> None:
        for name, cap in zip(REASONS, (max_num_queued_reqs, max_num_queued_tokens), strict=True):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {cap}")
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self._lock = threading.Lock()
        self._rejections = dict.fromkeys(REASONS, 0)

    @classmethod
    def of(cls, scheduler: SchedulerConfig) -> AdmissionControl:
        """The caps of a scheduler config (``--max-num-queued-reqs/-tokens``)."""
        return cls(scheduler.max_num_queued_reqs, scheduler.max_num_queued_tokens)

    def refusal(self, load: Load, seqs: int = 1) -> str | None:
        """The cap a request of ``seqs`` sequences would go over with ``load`` in
        flight (the request cap first), or None when it is admitted."""
        cap = self.max_num_queued_reqs
        if cap is not None and load.num_seqs + seqs > cap:
            return "max_num_queued_reqs"
        cap = self.max_num_queued_tokens
        if cap is not None and load.num_prefill_tokens >= cap:
            return "max_num_queued_tokens"
        return None

    def check(self, load: Load, seqs: int = 1) -> None:
        """Raises `AdmissionRejectedError` (and counts it once) when `refusal` names a
        cap."""
        reason = self.refusal(load, seqs)
        if reason is None:
            return
        with self._lock:
            self._rejections[reason] += 1
        raise AdmissionRejectedError(reason)

    def rejections(self) -> dict[str, int]:
        """Requests refused so far, by reason (every reason, 0 included)."""
        with self._lock:
            return dict(self._rejections)
