"""Per-step statistics for metrics and logs (host side, pure Python).

The output processor fills one `IterationStats` per engine step from the outputs it
applies: tokens, time to first token, inter-token latencies and the requests that
finished. Together with the scheduler's `SchedulerStats` snapshot it is everything
the Prometheus metrics (`metrics.loggers`) and the periodic log line need.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class FinishedRequestStats:
    """One request that finished (not aborted) in this step."""

    finish_reason: str
    """"stop" or "length" (of its first sequence)."""
    e2e_latency: float
    """Seconds from arrival to the last token."""
    num_prompt_tokens: int
    num_generation_tokens: int
    """Summed over the request's ``n`` sequences."""
    max_tokens: int | None
    queued_time: float
    """Seconds from arrival to the first schedule."""
    prefill_time: float
    """Seconds from the first schedule to the first token."""
    decode_time: float
    """Seconds from the first token to the last."""
    time_per_output_token: float
    """decode_time / (tokens of the longest sequence - 1); 0 with one token."""
    n: int
    """The request's ``n`` (its number of sequences)."""
    max_num_generation_tokens: int
    """Tokens of its longest sequence (``num_generation_tokens`` when n == 1)."""
    num_cached_tokens: int
    """Prompt tokens found in the prefix cache when it was first scheduled."""
    num_preemptions: int = 0
    """Times the scheduler preempted it (recompute or swap; summed over its ``n``
    sequences)."""

    @property
    def inference_time(self) -> float:
        """Seconds from the first schedule to the last token (prefill + decode)."""
        return self.prefill_time + self.decode_time

    @property
    def num_prefill_kv_computed_tokens(self) -> int:
        """Prompt tokens whose KV its prefill computed (the cached ones excluded)."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclasses.dataclass
class IterationStats:
    """What one engine step produced."""

    iteration_timestamp: float = dataclasses.field(default_factory=time.time)
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests whose first token came in this step."""
    num_cached_prompt_tokens: int = 0
    """Of those, the tokens found in the prefix cache (their KV was not computed)."""
    num_generation_tokens: int = 0
    """Tokens generated in this step, over every sequence."""
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = dataclasses.field(default_factory=list)
    num_aborted: int = 0
    prefilled_request_ids: list[str] = dataclasses.field(default_factory=list)
    """Requests whose sequence got its first token in this step, once per sequence (a
    request with n sequences appears up to n times): they leave the prefill backlog
    that admission control weighs (`entrypoints.streams.StreamTable.prefilled`)."""
