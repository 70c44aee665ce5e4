"""vLLM's deprecated metric families, shown with ``--show-hidden-metrics-for-version``.

vLLM retires a metric name over three releases: deprecated in X.Y (still exposed,
its help saying so), hidden from X.Y+1 unless ``--show-hidden-metrics-for-version``
names X.Y, removed in X.Y+2. This engine exposes the new names; `HIDDEN_FAMILIES`
are the old ones vLLM hid in favour of them, each fed from the stats its
replacement reads, so an old and a new name never disagree:

- ``gpu_cache_usage_perc`` (a gauge, now ``kv_cache_usage_perc``),
  ``gpu_prefix_cache_queries`` and ``gpu_prefix_cache_hits`` (counters, now
  ``prefix_cache_queries`` and ``prefix_cache_hits``): deprecated in 0.9.2, hidden
  from 0.11 (shown there with 0.10), removed in 0.12;
- ``time_per_output_token_seconds`` (a histogram, now
  ``inter_token_latency_seconds``, with its buckets): deprecated in 0.11, hidden
  from 0.12 (shown there with 0.11).

`shown_families` picks them for a version: a family shows for every version up to
the release that hid it (compared by major.minor), which covers vLLM's own value
(the release before, which deprecated it) and the flag's help ("hidden since the
specified version"). They are exposed under ``vllm:`` only: they were never
``jaxengine:`` names. Host side, no jax.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxengine.config.observability import release_of
from jaxengine.core.sched_output import SchedulerStats
from jaxengine.metrics.families import LABELS, TOKEN_LATENCY_BUCKETS, PrefixedCollector
from jaxengine.metrics.stats import IterationStats

logger = logging.getLogger("jaxengine.metrics")


@dataclasses.dataclass(frozen=True)
class HiddenFamily:
    """One deprecated family: its bare name (vLLM's without ``vllm:``), its type,
    the stat that feeds it, the vLLM release that hid it and its help."""

    name: str
    kind: type
    source: str
    """A Gauge: the `SchedulerStats` field it is set to; a Counter: the cumulative
    `SchedulerStats` counter whose increase it counts; a Histogram: the
    `IterationStats` list it observes."""
    hidden_since: tuple[int, int]
    help: str


HIDDEN_FAMILIES = (
    HiddenFamily(
        "gpu_cache_usage_perc", Gauge, "kv_cache_usage", (0, 11),
        "GPU KV-cache usage, 1 meaning 100 percent. DEPRECATED: use "
        "vllm:kv_cache_usage_perc instead.",
    ),
    HiddenFamily(
        "gpu_prefix_cache_queries", Counter, "prefix_cache_queries", (0, 11),
        "GPU prefix-cache queries, in queried tokens. DEPRECATED: use "
        "vllm:prefix_cache_queries instead.",
    ),
    HiddenFamily(
        "gpu_prefix_cache_hits", Counter, "prefix_cache_hits", (0, 11),
        "GPU prefix-cache hits, in cached tokens. DEPRECATED: use vllm:prefix_cache_hits "
        "instead.",
    ),
    HiddenFamily(
        "time_per_output_token_seconds", Histogram, "inter_token_latencies", (0, 12),
        "Time per output token in seconds. DEPRECATED: use "
        "vllm:inter_token_latency_seconds instead.",
    ),
)  # fmt: skip


def shown_families(version: str | None) -> tuple[HiddenFamily, ...]:
    """The families ``--show-hidden-metrics-for-version=version`` shows: those hidden
    at or after its major.minor (none without a version)."""
    if version is None:
        return ()
    release = release_of(version)
    return tuple(f for f in HIDDEN_FAMILIES if release <= f.hidden_since)


class HiddenMetrics:
    """The families a version shows, in a registry of their own; `collector` exposes
    them under ``vllm:``. A version that shows none is logged as a warning."""

    def __init__(self, version: str | None) -> None:
        self.families = shown_families(version)
        self.registry = CollectorRegistry()
        self.collector = PrefixedCollector(self.registry, ("vllm:",))
        self._metrics = {f.name: _make(f, self.registry) for f in self.families}
        if version is not None and not self.families:
            logger.warning(
                "--show-hidden-metrics-for-version %s shows no metric: the deprecated "
                "families kept here were hidden in vLLM %d.%d or earlier",
                version,
                *max(f.hidden_since for f in HIDDEN_FAMILIES),
            )

    def bind(self, labels: Iterable[str]) -> EngineHiddenMetrics:
        """One engine's series (``labels``: its model name and engine index)."""
        labels = tuple(labels)
        return EngineHiddenMetrics(
            {f: self._metrics[f.name].labels(*labels) for f in self.families}
        )


def _make(family: HiddenFamily, registry: CollectorRegistry) -> Any:
    kwargs = {"buckets": TOKEN_LATENCY_BUCKETS} if family.kind is Histogram else {}
    return family.kind(family.name, family.help, LABELS, registry=registry, **kwargs)


class EngineHiddenMetrics:
    """One engine's children of the shown families, fed as their replacements are."""

    def __init__(self, children: Mapping[HiddenFamily, Any]) -> None:
        self.children = dict(children)

    def record_scheduler(self, stats: SchedulerStats, increases: Mapping[str, int]) -> None:
        """Gauges from the `SchedulerStats` snapshot; counters by ``increases`` (each
        cumulative field's increase since the last snapshot)."""
        for family, child in self.children.items():
            if family.kind is Gauge:
                child.set(getattr(stats, family.source))
            elif family.kind is Counter:
                child.inc(increases[family.source])

    def record_iteration(self, stats: IterationStats) -> None:
        """Histograms from a step's `IterationStats`."""
        for family, child in self.children.items():
            if family.kind is Histogram:
                for value in getattr(stats, family.source):
                    child.observe(value)
