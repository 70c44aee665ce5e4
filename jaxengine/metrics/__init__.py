"""Metrics: what an engine step measured and where it goes (host side, no jax).

- `stats`: `IterationStats` (a step's tokens and latencies) and
  `FinishedRequestStats`, which the output processor fills;
- `loggers`: `PrometheusStatLogger` (vLLM's families under ``vllm:`` and
  ``jaxengine:``) and `LoggingStatLogger` (the periodic stats line), the stat
  loggers the engine fronts hand each step's `SchedulerStats` and `IterationStats`;
- `families`: the families' names, buckets and labels, and the collector that
  exposes each under both prefixes;
- `hidden`: vLLM's hidden deprecated families, registered for
  ``--show-hidden-metrics-for-version`` (under ``vllm:`` only);
- `reader`: `LLM.get_metrics()`'s records (`Counter`, `Gauge`, `Histogram`,
  `Vector`) read from a registry.
"""
