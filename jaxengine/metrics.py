"""Prometheus metrics and the periodic stats log line (host side, no jax).

After every engine step the engine hands each stat logger the scheduler's snapshot
(`SchedulerStats`) and what the step produced (`IterationStats`, or None):

- `PrometheusStatLogger` keeps vLLM-named metrics (prefix ``jaxengine:`` instead of
  ``vllm:``), every one labelled ``model_name``, in its own `CollectorRegistry`;
  `render_metrics` turns a registry into the body of ``GET /metrics``.
- `LoggingStatLogger` accumulates tokens and logs one INFO line per interval
  (throughput, queue sizes, KV-cache usage, prefix-cache hit rate); an idle engine
  stays quiet.

`SchedulerStats` counters (preemptions, prefix-cache queries and hits) are cumulative;
both loggers turn them into deltas. A value lower than the last one seen means the
source was reset (e.g. a new scheduler): the new value itself is then the delta.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxengine.core.sched_output import SchedulerStats
from jaxengine.engine.stats import FinishedRequestStats, IterationStats

logger = logging.getLogger("jaxengine.metrics")

PREFIX = "jaxengine:"
FINISH_REASONS = ("stop", "length", "abort")
"""request_success label values, pre-created so they are exposed at 0."""

# fmt: off
# Bucket boundaries as in vLLM v1 (`vllm/v1/metrics/loggers.py`).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Per finished request: (metric suffix, FinishedRequestStats field, buckets key, help).
_REQUEST_HISTOGRAMS = (
    ("e2e_request_latency_seconds", "e2e_latency", "request",
     "End-to-end request latency in seconds (arrival to last token)."),
    ("request_queue_time_seconds", "queued_time", "request",
     "Seconds a request spent waiting before its first schedule."),
    ("request_prefill_time_seconds", "prefill_time", "request",
     "Seconds from a request's first schedule to its first token."),
    ("request_decode_time_seconds", "decode_time", "request",
     "Seconds from a request's first token to its last."),
    ("request_time_per_output_token_seconds", "time_per_output_token", "token",
     "Mean seconds per output token after the first, per request."),
    ("request_prompt_tokens", "num_prompt_tokens", "tokens",
     "Number of prompt tokens per finished request."),
    ("request_generation_tokens", "num_generation_tokens", "tokens",
     "Number of generated tokens per finished request (all sequences)."),
    ("request_params_max_tokens", "max_tokens", "tokens",
     "The max_tokens sampling parameter per finished request."),
)

# Per engine step, from IterationStats: (class, metric suffix, buckets key, help).
_STEP_METRICS = (
    (Counter, "prompt_tokens", None, "Prefill tokens processed."),
    (Counter, "generation_tokens", None, "Generation tokens processed."),
    (Histogram, "time_to_first_token_seconds", "ttft", "Time to first token in seconds."),
    (Histogram, "inter_token_latency_seconds", "token", "Seconds between consecutive tokens."),
    (Histogram, "iteration_tokens_total", "tokens", "Prompt + generation tokens per step."),
)
# fmt: on

_GAUGES = (  # (metric suffix, SchedulerStats field, help)
    ("num_requests_running", "num_running", "Number of requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting (swapped included)."),
    ("num_requests_swapped", "num_swapped", "Number of requests swapped out to host memory."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage: 1 means 100 percent."),
)

_CUMULATIVE_COUNTERS = (  # (metric suffix, SchedulerStats field, help)
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including the last one <= `max_value`."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of `registry`."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _delta(current: int, last: int) -> int:
    """Increase of a cumulative counter; a drop means a reset, so count from 0."""
    return current - last if current >= last else current


class PrometheusStatLogger:
    """vLLM-style Prometheus metrics for one model, in a registry it owns by default.

    `record` may be called from the engine thread while the server renders
    `registry` from another: prometheus_client metrics are thread-safe, and a lock
    guards the last-seen cumulative values.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 8192,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._last_cumulative = {field: 0 for _, field, _ in _CUMULATIVE_COUNTERS}
        buckets = {
            "ttft": TTFT_BUCKETS,
            "request": REQUEST_LATENCY_BUCKETS,
            "token": TOKEN_LATENCY_BUCKETS,
            "tokens": build_1_2_5_buckets(max_model_len),
        }
        self._gauges = {f: self._make(Gauge, n, h) for n, f, h in _GAUGES}
        self._cumulative = {f: self._make(Counter, n, h) for n, f, h in _CUMULATIVE_COUNTERS}
        self._request_histograms = {
            field: self._make(Histogram, name, help_, buckets[kind])
            for name, field, kind, help_ in _REQUEST_HISTOGRAMS
        }
        self._step = {
            name: self._make(cls, name, help_, buckets.get(kind))
            for cls, name, kind, help_ in _STEP_METRICS
        }
        self._success_metric = Counter(
            PREFIX + "request_success",
            "Count of finished requests, by finish reason (stop, length, abort).",
            labelnames=("model_name", "finished_reason"),
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # expose every reason from the start, at 0
            self._success_metric.labels(model_name, reason)

    def _make(self, cls: type, name: str, help_: str, buckets=None):
        """One metric labelled with this model's name; returns its child."""
        kwargs = {} if buckets is None else {"buckets": buckets}
        metric = cls(PREFIX + name, help_, ("model_name",), registry=self.registry, **kwargs)
        return metric.labels(self.model_name)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Update every metric from one engine step."""
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        for field, gauge in self._gauges.items():
            gauge.set(getattr(stats, field))
        with self._lock:
            for field, counter in self._cumulative.items():
                current = getattr(stats, field)
                counter.inc(_delta(current, self._last_cumulative[field]))
                self._last_cumulative[field] = current

    def _record_iteration(self, stats: IterationStats) -> None:
        step = self._step
        step["prompt_tokens"].inc(stats.num_prompt_tokens)
        step["generation_tokens"].inc(stats.num_generation_tokens)
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens:  # idle loops report aborts with no step behind them
            step["iteration_tokens_total"].observe(step_tokens)
        for ttft in stats.time_to_first_tokens:
            step["time_to_first_token_seconds"].observe(ttft)
        for itl in stats.inter_token_latencies:
            step["inter_token_latency_seconds"].observe(itl)
        for finished in stats.finished_requests:
            self._record_finished(finished)
        if stats.num_aborted:
            self._success_metric.labels(self.model_name, "abort").inc(stats.num_aborted)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self._success_metric.labels(self.model_name, finished.finish_reason).inc()
        for field, histogram in self._request_histograms.items():
            value = getattr(finished, field)
            if value is not None:
                histogram.observe(value)


class LoggingStatLogger:
    """Logs one INFO line at most every `interval` seconds, summarising the window
    since the previous line. `log` may be called as often as wanted; it stays quiet
    while the engine is idle (no tokens, no finished requests, nothing queued)."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last_log_time = clock()
        self._latest: SchedulerStats | None = None
        self._logged_queries = 0  # cumulative prefix-cache counters at the last line
        self._logged_hits = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_finished = 0

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Accumulate one engine step."""
        with self._lock:
            if scheduler_stats is not None:
                self._latest = scheduler_stats
            if iteration_stats is not None:
                self._prompt_tokens += iteration_stats.num_prompt_tokens
                self._generation_tokens += iteration_stats.num_generation_tokens
                self._num_finished += (
                    len(iteration_stats.finished_requests) + iteration_stats.num_aborted
                )

    def log(self, now: float | None = None) -> str | None:
        """Log (and return) the line if `interval` has passed and the engine was not
        idle; otherwise return None. An idle window is dropped, so the next line's
        rates are not diluted by idle time."""
        now = self._clock() if now is None else now
        with self._lock:
            elapsed = now - self._last_log_time
            if elapsed < self.interval or elapsed <= 0:  # at most one line per interval
                return None
            line = None if self._is_idle() else self._format(elapsed)
            self._close_window(now)
        if line is not None:
            logger.info(line)
        return line

    def _is_idle(self) -> bool:
        busy = self._latest is not None and (self._latest.num_running or self._latest.num_waiting)
        return not (busy or self._prompt_tokens or self._generation_tokens or self._num_finished)

    def _format(self, elapsed: float) -> str:
        stats = self._latest or SchedulerStats(0, 0, 0, 0.0, 0, 0, 0)
        queries = _delta(stats.prefix_cache_queries, self._logged_queries)
        hits = _delta(stats.prefix_cache_hits, self._logged_hits)
        hit_rate = 100.0 * hits / queries if queries else 0.0
        line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if stats.num_swapped:
            line += f", Swapped: {stats.num_swapped} reqs"
        return line

    def _close_window(self, now: float) -> None:
        self._last_log_time = now
        if self._latest is not None:
            self._logged_queries = self._latest.prefix_cache_queries
            self._logged_hits = self._latest.prefix_cache_hits
        self._reset_window()
