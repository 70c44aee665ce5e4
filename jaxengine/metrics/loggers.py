"""Prometheus metrics and the periodic stats log line (host side, no jax).

After every engine step the engine hands each stat logger the scheduler's snapshot
(`SchedulerStats`) and what the step produced (`IterationStats`, or None):

- `PrometheusStatLogger` keeps vLLM's metrics, every one labelled ``model_name`` and
  ``engine`` (the data-parallel replica's index) as vLLM labels them, in its own
  `CollectorRegistry`; `render_metrics` turns a registry into the body of
  ``GET /metrics``.
- `LoggingStatLogger` accumulates tokens and logs one INFO line per interval
  (throughput, queue sizes, KV-cache usage, prefix-cache hit rate); an idle engine
  stays quiet. With data parallelism each replica has its own, its lines prefixed
  ``Engine 000:`` as in vLLM.

Names: both ``vllm:`` and ``jaxengine:``. Every family is exposed under vLLM's exact
name (``vllm:num_requests_running``), which vLLM's dashboards, autoscalers (KEDA,
HPA adapters) and tests read, and under the same name with this project's prefix
(``jaxengine:num_requests_running``), which existing users and tests read. Both are
always on, with no flag: a flag would only choose which of two correct names a
scrape lacks, and the cost of both is a larger scrape. There is one source of truth:
the metrics are registered once, with bare names, in a private registry, and a
`metrics.families.PrefixedCollector` in `registry` yields each family once per prefix
from the same samples, so an observation is made once and the two names never
disagree. The ``jaxengine:`` families keep today's label sets; the ``vllm:`` ones
have vLLM's (they differ only for ``lora_requests_info``, which in vLLM has no
``model_name`` or ``engine`` label).

The families follow vLLM v1's ``PrometheusStatLogger`` for every feature this engine
has: scheduler state (``num_requests_running``, ``num_requests_waiting``,
``num_requests_waiting_by_reason``, ``kv_cache_usage_perc``, and v0's
``num_requests_swapped``, since requests swap here), prefix caching, token counters
(``prompt_tokens``, ``prompt_tokens_by_source``, ``prompt_tokens_cached``,
``generation_tokens``), ``request_success`` by finish reason, ``iteration_tokens_total``,
TTFT and inter-token latency, one histogram per finished request for each of its
latencies and sizes, ``cache_config_info`` (when the engine's cache is given),
``admission_rejections_total`` (the server's admission control, `watch_admission`),
and LoRA's and speculative decoding's families below. docs/architecture.md lists vLLM's
series that are left out because their feature is not here. vLLM's hidden deprecated
names (``gpu_cache_usage_perc``, ...) come with ``show_hidden_metrics_for_version``
(`metrics.hidden`), under ``vllm:`` only.

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
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxengine.core.sched_output import SchedulerStats, SpecDecodingStats
from jaxengine.metrics.families import (
    CUMULATIVE_COUNTERS,
    GAUGES,
    LABELLED,
    LABELS,
    LORA_LABELS,
    PREFIXES,
    REQUEST_HISTOGRAMS,
    SLEEP_STATES,
    SPEC_COUNTERS,
    STEP_METRICS,
    AdmissionRejections,
    PrefixedCollector,
    bucket_sets,
)
from jaxengine.metrics.hidden import EngineHiddenMetrics, HiddenMetrics
from jaxengine.metrics.stats import FinishedRequestStats, IterationStats

logger = logging.getLogger("jaxengine.metrics")


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of `registry`."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _delta(current: int, last: int) -> int:
    """Increase of a cumulative counter; a drop means a reset, so count from 0."""
    return current - last if current >= last else current


class PrometheusStatLogger:
    """vLLM's Prometheus metrics for one model, in a registry it owns by default.

    Every sample is labelled ``model_name`` and ``engine`` (the data-parallel replica,
    "0" when there is one), as vLLM labels them. `record` takes the engine's index;
    `for_engine(i)` gives a logger with the plain ``record(scheduler_stats,
    iteration_stats)`` signature that records as engine ``i``, for that replica's
    engine thread. ``cache_config_info`` (`metrics.families.cache_config_info`) adds
    vLLM's ``cache_config_info`` gauge: 1, labelled with the cache config and the
    engine, one series per engine. ``show_hidden_metrics_for_version`` adds the
    deprecated names vLLM hid that this version still showed (`metrics.hidden`).

    The metrics live in ``families`` under bare names; ``registry`` holds one
    `PrefixedCollector` that exposes them as ``vllm:*`` and ``jaxengine:*``.

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
        cache_config_info: Mapping[str, str] | None = None,
        show_hidden_metrics_for_version: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.families = CollectorRegistry()
        self.registry.register(PrefixedCollector(self.families, PREFIXES))
        self.hidden = HiddenMetrics(show_hidden_metrics_for_version)
        self.registry.register(self.hidden.collector)
        self._lock = threading.Lock()
        shared = self._shared(max_model_len)
        self._engines = {
            index: _EngineMetrics.of((model_name, str(index)), **shared) for index in engine_indexes
        }
        if cache_config_info is not None:
            self._cache_config_gauge(cache_config_info, engine_indexes)
        self._lora_info: Gauge | None = None  # registered on the first LoRA snapshot
        self._spec: dict | None = None  # registered on the first speculative snapshot

    def _shared(self, max_model_len: int) -> dict:
        """The metrics every engine's `_EngineMetrics` binds its labels in."""
        buckets = bucket_sets(max_model_len)
        return {
            "gauges": {f: self._make(Gauge, n, h) for n, f, h in GAUGES},
            "cumulative": {f: self._make(Counter, n, h) for n, f, h in CUMULATIVE_COUNTERS},
            "request_histograms": {
                field: self._make(Histogram, name, help_, buckets[kind])
                for name, field, kind, help_ in REQUEST_HISTOGRAMS
            },
            "step": {
                name: self._make(cls, name, help_, buckets.get(kind))
                for cls, name, kind, help_ in STEP_METRICS
            },
            "labelled": {
                name: (self._make(cls, name, help_, extra=label), values)
                for cls, name, label, values, help_ in LABELLED
            },
            "hidden": self.hidden,
        }

    def _make(self, cls: type, name: str, help_: str, buckets=None, extra: str | None = None):
        """One metric labelled with the model's name and the engine's index (and
        ``extra``, when given)."""
        kwargs = {} if buckets is None else {"buckets": buckets}
        labels = LABELS if extra is None else (*LABELS, extra)
        return cls(name, help_, labels, registry=self.families, **kwargs)

    def _cache_config_gauge(self, info: Mapping[str, str], engine_indexes) -> None:
        """vLLM's ``cache_config_info``: an info gauge (always 1) per engine, labelled
        with the cache config and the engine (no ``model_name``, as in vLLM)."""
        gauge = Gauge(
            "cache_config_info",
            "Information of the engine's CacheConfig.",
            (*info, "engine"),
            registry=self.families,
        )
        for index in engine_indexes:
            gauge.labels(*info.values(), str(index)).set(1)

    def _lora_gauge(self) -> Gauge:
        """vLLM's ``lora_requests_info`` (the caller holds the lock); registered only
        once LoRA shows up, so a server without it exposes no empty family."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "lora_requests_info",
                "Running stats on lora requests.",
                (*LABELS, *LORA_LABELS),
                registry=self.families,
            )
        return self._lora_info

    def _spec_counters(self) -> dict:
        """vLLM's ``spec_decode_*`` counters (the caller holds the lock), registered
        only once speculative decoding shows up."""
        if self._spec is None:
            self._spec = {
                field: self._make(Counter, name, help_) for name, field, help_ in SPEC_COUNTERS
            }
            self._spec["accepted_per_pos"] = self._make(
                Counter,
                "spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens, by their position in the draft.",
                extra="position",
            )
        return self._spec

    def watch_admission(self, read: Callable[[], Mapping[str, int]]) -> None:
        """Exposes the engine front's admission rejections by reason (``read``, e.g.
        `EngineClient.admission_rejections`) as ``admission_rejections_total``."""
        self.families.register(AdmissionRejections(self.model_name, read))

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


@dataclasses.dataclass
class _EngineMetrics:
    """One engine's children of the metrics (its label values bound)."""

    gauges: dict
    cumulative: dict
    request_histograms: dict
    step: dict
    labelled: dict  # metric name -> {extra label value -> child}
    last_cumulative: dict
    hidden: EngineHiddenMetrics  # vLLM's deprecated families the version shows
    labels: tuple[str, str] = ("", "")  # (model_name, engine)
    lora_labels: tuple[str, ...] | None = None  # of the engine's lora_requests_info series
    last_spec: SpecDecodingStats = dataclasses.field(default_factory=SpecDecodingStats)

    @classmethod
    def of(
        cls, labels, gauges, cumulative, request_histograms, step, labelled, hidden
    ) -> _EngineMetrics:
        def bind(metrics: dict) -> dict:
            return {key: metric.labels(*labels) for key, metric in metrics.items()}

        metrics = cls(
            gauges=bind(gauges),
            cumulative=bind(cumulative),
            request_histograms=bind(request_histograms),
            step=bind(step),
            # every value of the extra label exposed from the start, at 0
            labelled={
                name: {value: metric.labels(*labels, value) for value in values}
                for name, (metric, values) in labelled.items()
            },
            last_cumulative={field: 0 for _, field, _ in CUMULATIVE_COUNTERS},
            hidden=hidden.bind(labels),
            labels=labels,
        )
        metrics.labelled["engine_sleep_state"]["awake"].set(1)  # an engine starts awake
        return metrics

    def record_scheduler(self, stats: SchedulerStats) -> None:
        """Gauges and cumulative counters (the caller holds the lock)."""
        for field, gauge in self.gauges.items():
            gauge.set(getattr(stats, field))
        waiting = self.labelled["num_requests_waiting_by_reason"]
        waiting["capacity"].set(stats.num_waiting - stats.num_deferred)
        waiting["deferred"].set(stats.num_deferred)
        for level, state in enumerate(SLEEP_STATES):
            self.labelled["engine_sleep_state"][state].set(int(stats.sleep_level == level))
        increases = {}
        for field, counter in self.cumulative.items():
            current = getattr(stats, field)
            increases[field] = _delta(current, self.last_cumulative[field])
            counter.inc(increases[field])
            self.last_cumulative[field] = current
        self.hidden.record_scheduler(stats, increases)

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
        cached = stats.num_cached_prompt_tokens
        computed = stats.num_prompt_tokens - cached
        step["prompt_tokens"].inc(stats.num_prompt_tokens)
        step["prompt_tokens_cached"].inc(cached)
        by_source = self.labelled["prompt_tokens_by_source"]
        by_source["local_compute"].inc(computed)
        by_source["local_cache_hit"].inc(cached)
        step["generation_tokens"].inc(stats.num_generation_tokens)
        step_tokens = computed + stats.num_generation_tokens
        if step_tokens:  # idle loops report aborts with no step behind them
            step["iteration_tokens_total"].observe(step_tokens)
        for ttft in stats.time_to_first_tokens:
            step["time_to_first_token_seconds"].observe(ttft)
        for itl in stats.inter_token_latencies:
            step["inter_token_latency_seconds"].observe(itl)
        for finished in stats.finished_requests:
            self._record_finished(finished)
        if stats.num_aborted:
            self.labelled["request_success"]["abort"].inc(stats.num_aborted)
        self.hidden.record_iteration(stats)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self.labelled["request_success"][finished.finish_reason].inc()
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
