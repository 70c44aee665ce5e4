"""Prometheus metrics and the periodic stats log line (host side, no jax).

After every engine step the engine hands each stat logger the scheduler's snapshot
(`SchedulerStats`) and what the step produced (`IterationStats`, or None):

- `PrometheusStatLogger` keeps vLLM-named metrics (prefix ``jaxengine:`` instead of
  ``vllm:``), every one labelled ``model_name`` and ``engine`` (the data-parallel
  replica's index), in its own `CollectorRegistry`; `render_metrics` turns a registry
  into the body of ``GET /metrics``.
- `LoggingStatLogger` accumulates tokens and logs one INFO line per interval
  (throughput, queue sizes, KV-cache usage, prefix-cache hit rate); an idle engine
  stays quiet. With data parallelism each replica has its own, its lines prefixed
  ``Engine 000:`` as in vLLM.

With LoRA on (``SchedulerStats.max_lora`` > 0) there is also vLLM's
``lora_requests_info``: one series per engine, labelled ``max_lora`` and the
comma-joined names of the adapters with ``running_lora_adapters`` and
``waiting_lora_adapters`` requests, whose value is the time of the latest snapshot.

With speculative decoding on (``SchedulerStats.spec_decoding`` set) there are also
vLLM's ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos``
(labelled ``position``), and the log line adds the window's draft acceptance rate,
mean acceptance length and per-position acceptance rates.

`SchedulerStats` counters (preemptions, prefix-cache queries and hits) are cumulative;
both loggers turn them into deltas. A value lower than the last one seen means the
source was reset (e.g. a new scheduler): the new value itself is then the delta.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxengine.core.sched_output import SchedulerStats, SpecDecodingStats
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

    Every sample is labelled ``model_name`` and ``engine`` (the data-parallel replica,
    "0" when there is one), as vLLM labels them. `record` takes the engine's index;
    `for_engine(i)` gives a logger with the plain ``record(scheduler_stats,
    iteration_stats)`` signature that records as engine ``i``, for that replica's
    engine thread.

    `record` may be called from engine threads while the server renders `registry`
    from another: prometheus_client metrics are thread-safe, and a lock guards the
    last-seen cumulative values.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 8192,
        engine_indexes: Sequence[int] = (0,),
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        buckets = {
            "ttft": TTFT_BUCKETS,
            "request": REQUEST_LATENCY_BUCKETS,
            "token": TOKEN_LATENCY_BUCKETS,
            "tokens": build_1_2_5_buckets(max_model_len),
        }
        gauges = {f: self._make(Gauge, n, h) for n, f, h in _GAUGES}
        cumulative = {f: self._make(Counter, n, h) for n, f, h in _CUMULATIVE_COUNTERS}
        request_histograms = {
            field: self._make(Histogram, name, help_, buckets[kind])
            for name, field, kind, help_ in _REQUEST_HISTOGRAMS
        }
        step = {
            name: self._make(cls, name, help_, buckets.get(kind))
            for cls, name, kind, help_ in _STEP_METRICS
        }
        success = Counter(
            PREFIX + "request_success",
            "Count of finished requests, by finish reason (stop, length, abort).",
            labelnames=("model_name", "engine", "finished_reason"),
            registry=self.registry,
        )
        self._engines = {
            index: _EngineMetrics.of(
                (model_name, str(index)), gauges, cumulative, request_histograms, step, success
            )
            for index in engine_indexes
        }
        self._lora_info: Gauge | None = None  # registered on the first LoRA snapshot
        self._spec: dict | None = None  # registered on the first speculative snapshot

    def _make(self, cls: type, name: str, help_: str, buckets=None):
        """One metric labelled with the model's name and the engine's index."""
        kwargs = {} if buckets is None else {"buckets": buckets}
        return cls(PREFIX + name, help_, _LABELS, registry=self.registry, **kwargs)

    def _lora_gauge(self) -> Gauge:
        """vLLM's ``lora_requests_info`` (the caller holds the lock); registered only
        once LoRA shows up, so a server without it exposes no empty family."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                PREFIX + "lora_requests_info",
                "Running stats on lora requests.",
                (*_LABELS, *_LORA_LABELS),
                registry=self.registry,
            )
        return self._lora_info

    def _spec_counters(self) -> dict:
        """vLLM's ``spec_decode_*`` counters (the caller holds the lock), registered
        only once speculative decoding shows up."""
        if self._spec is None:
            self._spec = {
                field: self._make(Counter, name, help_) for name, field, help_ in _SPEC_COUNTERS
            }
            self._spec["accepted_per_pos"] = Counter(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens, by their position in the draft.",
                (*_LABELS, "position"),
                registry=self.registry,
            )
        return self._spec

    def for_engine(self, engine_idx: int) -> _EngineStatLogger:
        """A stat logger that records into this one as engine ``engine_idx``."""
        if engine_idx not in self._engines:
            raise ValueError(f"engine {engine_idx} is not one of {sorted(self._engines)}")
        return _EngineStatLogger(self, engine_idx)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """Update every metric of engine ``engine_idx`` from one of its steps."""
        metrics = self._engines[engine_idx]
        if scheduler_stats is not None:
            with self._lock:
                metrics.record_scheduler(scheduler_stats)
                if scheduler_stats.max_lora > 0:
                    metrics.record_lora(scheduler_stats, self._lora_gauge(), time.time())
                if scheduler_stats.spec_decoding is not None:
                    metrics.record_spec(scheduler_stats.spec_decoding, self._spec_counters())
        if iteration_stats is not None:
            metrics.record_iteration(iteration_stats)


_SPEC_COUNTERS = (  # (metric suffix, SpecDecodingStats field, help)
    ("spec_decode_num_drafts", "num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Number of accepted tokens."),
)
_LABELS = ("model_name", "engine")
_LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


@dataclasses.dataclass
class _EngineMetrics:
    """One engine's children of the metrics (its label values bound)."""

    gauges: dict
    cumulative: dict
    request_histograms: dict
    step: dict
    success: dict  # finish reason -> counter child
    last_cumulative: dict
    labels: tuple[str, str] = ("", "")  # (model_name, engine)
    lora_labels: tuple[str, ...] | None = None  # of the engine's lora_requests_info series
    last_spec: SpecDecodingStats = dataclasses.field(default_factory=SpecDecodingStats)

    @classmethod
    def of(cls, labels, gauges, cumulative, request_histograms, step, success) -> _EngineMetrics:
        def bind(metrics: dict) -> dict:
            return {key: metric.labels(*labels) for key, metric in metrics.items()}

        return cls(
            gauges=bind(gauges),
            cumulative=bind(cumulative),
            request_histograms=bind(request_histograms),
            step=bind(step),
            # every reason exposed from the start, at 0
            success={reason: success.labels(*labels, reason) for reason in FINISH_REASONS},
            last_cumulative={field: 0 for _, field, _ in _CUMULATIVE_COUNTERS},
            labels=labels,
        )

    def record_scheduler(self, stats: SchedulerStats) -> None:
        """Gauges and cumulative counters (the caller holds the lock)."""
        for field, gauge in self.gauges.items():
            gauge.set(getattr(stats, field))
        for field, counter in self.cumulative.items():
            current = getattr(stats, field)
            counter.inc(_delta(current, self.last_cumulative[field]))
            self.last_cumulative[field] = current

    def record_lora(self, stats: SchedulerStats, gauge: Gauge, now: float) -> None:
        """Sets this engine's ``lora_requests_info`` series to ``now`` (the caller
        holds the lock). Unlike vLLM, which keeps every label set it has seen, a new
        set of adapters replaces the engine's previous series: the family stays one
        series per engine however many adapter combinations come and go."""
        labels = (
            *self.labels,
            str(stats.max_lora),
            ",".join(sorted(stats.waiting_lora_adapters)),
            ",".join(sorted(stats.running_lora_adapters)),
        )
        if self.lora_labels is not None and self.lora_labels != labels:
            gauge.remove(*self.lora_labels)
        gauge.labels(*labels).set(now)
        self.lora_labels = labels

    def record_spec(self, stats: SpecDecodingStats, counters: dict) -> None:
        """The ``spec_decode_*`` counters' increase since the last snapshot (the
        caller holds the lock)."""
        last = self.last_spec
        if stats.num_drafts < last.num_drafts:  # a new scheduler: count from 0
            last = SpecDecodingStats()
        for field, counter in counters.items():
            if field != "accepted_per_pos":
                counter.labels(*self.labels).inc(getattr(stats, field) - getattr(last, field))
        per_pos = counters["accepted_per_pos"]
        for pos, count in enumerate(stats.accepted_per_pos):
            before = last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0
            per_pos.labels(*self.labels, str(pos)).inc(count - before)
        self.last_spec = stats

    def record_iteration(self, stats: IterationStats) -> None:
        step = self.step
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
            self.success["abort"].inc(stats.num_aborted)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self.success[finished.finish_reason].inc()
        for field, histogram in self.request_histograms.items():
            value = getattr(finished, field)
            if value is not None:
                histogram.observe(value)


class _EngineStatLogger:
    """`PrometheusStatLogger.for_engine`: records as one engine."""

    def __init__(self, parent: PrometheusStatLogger, engine_idx: int) -> None:
        self.parent = parent
        self.engine_idx = engine_idx

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        self.parent.record(scheduler_stats, iteration_stats, self.engine_idx)


class LoggingStatLogger:
    """Logs one INFO line at most every `interval` seconds, summarising the window
    since the previous line. `log` may be called as often as wanted; it stays quiet
    while the engine is idle (no tokens, no finished requests, nothing queued).
    With ``engine_index`` (data parallelism) the line starts ``Engine 001: ``."""

    def __init__(
        self,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        engine_index: int | None = None,
    ):
        self.interval = interval
        self.prefix = "" if engine_index is None else f"Engine {engine_index:03d}: "
        self._clock = clock
        self._lock = threading.Lock()
        self._last_log_time = clock()
        self._latest: SchedulerStats | None = None
        self._logged_queries = 0  # cumulative prefix-cache counters at the last line
        self._logged_hits = 0
        self._logged_spec = SpecDecodingStats()
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
        line = self.prefix + (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if stats.num_swapped:
            line += f", Swapped: {stats.num_swapped} reqs"
        if stats.spec_decoding is not None:
            line += spec_decoding_summary(stats.spec_decoding, self._logged_spec)
        return line

    def _close_window(self, now: float) -> None:
        self._last_log_time = now
        if self._latest is not None:
            self._logged_queries = self._latest.prefix_cache_queries
            self._logged_hits = self._latest.prefix_cache_hits
            self._logged_spec = self._latest.spec_decoding or SpecDecodingStats()
        self._reset_window()


def spec_decoding_summary(now: SpecDecodingStats, before: SpecDecodingStats) -> str:
    """The log line's speculative-decoding part over a window: draft acceptance rate,
    mean acceptance length (tokens per verifying step, the bonus one included) and
    the per-position acceptance rates."""
    if now.num_drafts < before.num_drafts:
        before = SpecDecodingStats()
    drafts = now.num_drafts - before.num_drafts
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    if not drafts:
        return ", Spec decode: no drafts"
    old = list(before.accepted_per_pos) + [0] * len(now.accepted_per_pos)
    rates = ", ".join(f"{(n - old[i]) / drafts:.3f}" for i, n in enumerate(now.accepted_per_pos))
    return (
        f", Spec decode: draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%, "
        f"mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"accepted: {accepted} tokens, drafted: {drafted} tokens, "
        f"per-position acceptance rate: {rates}"
    )
