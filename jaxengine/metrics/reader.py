"""`LLM.get_metrics()`: an engine's Prometheus metrics as plain values (vLLM's reader).

Reads a `CollectorRegistry` (the `PrometheusStatLogger`'s) into a list of `Counter`,
`Gauge`, `Histogram` and `Vector` records, each with its name and labels, as vLLM's
``vllm.v1.metrics.reader`` gives them. A counter family with a ``position`` label
(``spec_decode_num_accepted_tokens_per_pos``) becomes one `Vector` per engine whose
values are indexed by position. Each family comes under both of its names
(``vllm:generation_tokens`` and ``jaxengine:generation_tokens``: one set of samples,
see `metrics.families.PrefixedCollector`). Host side, no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)
    """Cumulative counts by upper bound (``"+Inf"`` included), as Prometheus keeps them."""


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every metric of ``registry``, one record per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            out += _counters(family)
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _counters(family) -> list[Metric]:
    samples = [s for s in family.samples if s.name.endswith("_total")]
    if not any("position" in s.labels for s in samples):
        return [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
    vectors: dict[tuple, dict[int, int]] = {}
    for s in samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
        vectors.setdefault(labels, {})[int(s.labels["position"])] = int(s.value)
    return [
        Vector(family.name, dict(labels), [by_pos.get(i, 0) for i in range(max(by_pos) + 1)])
        for labels, by_pos in vectors.items()
    ]


def _histograms(family) -> list[Metric]:
    records: dict[tuple, Histogram] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        record = records.setdefault(key, Histogram(family.name, labels))
        if s.name.endswith("_bucket"):
            record.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            record.count = int(s.value)
        elif s.name.endswith("_sum"):
            record.sum = float(s.value)
    return list(records.values())
