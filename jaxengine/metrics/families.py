"""vLLM's metric families (names, types, labels, buckets), exposed under two prefixes.

The tables here say what `metrics.PrometheusStatLogger` registers: each family's bare
name (vLLM's name without ``vllm:``), its type, the stats field it reads, its help,
and its buckets, which are vLLM v1's. ``model_name`` and ``engine`` label every
family but ``cache_config_info``; the `LABELLED` ones add one label with a fixed set
of values, each series exposed from the start.

`PrefixedCollector` reads a registry whose metrics have bare names
(``num_requests_running``) and yields every family once per prefix, renamed, with the
same samples: ``vllm:num_requests_running`` and ``jaxengine:num_requests_running`` are
one gauge shown twice, so the two can never disagree and each observation is made
once. Families registered later (LoRA, speculative decoding) show up under both.

A prefix may narrow a family's labels to vLLM's set: vLLM's ``lora_requests_info``
has no ``model_name`` or ``engine`` label, so under ``vllm:`` those two are dropped.
Series that then coincide (data-parallel engines with the same adapters) are merged,
the largest value kept: the family's value is a timestamp, so that is the newest,
which is what vLLM's one shared gauge holds.

`cache_config_info` gives the labels of vLLM's ``cache_config_info`` gauge.
`AdmissionRejections` exposes the API server's admission-control refusals (vLLM's
``admission_rejections_total``), which belong to the engine front, not to an engine:
labelled ``model_name`` and ``reason``, no ``engine``. Host side, no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIXES = ("vllm:", "jaxengine:")
"""vLLM's prefix, which dashboards and autoscalers read, and this project's own."""

LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")
VLLM_NARROWED = {("vllm:", "lora_requests_info"): LORA_LABELS}
"""(prefix, family) -> the labels it keeps there (vLLM's label set)."""

CACHE_CONFIG_LABELS = {"kv_cache_dtype": "cache_dtype"}
"""CacheConfig fields whose vLLM field (and so label) has another name."""

FINISH_REASONS = ("stop", "length", "abort")
"""request_success label values, pre-created so they are exposed at 0."""

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""engine_sleep_state label values, by sleep level (0: awake, 1, 2)."""

# fmt: off
# Bucket boundaries as in vLLM v1 (`vllm/v1/metrics/loggers.py`).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# Per finished request: (metric name, FinishedRequestStats field, buckets key, help).
REQUEST_HISTOGRAMS = (
    ("e2e_request_latency_seconds", "e2e_latency", "request",
     "End-to-end request latency in seconds (arrival to last token)."),
    ("request_queue_time_seconds", "queued_time", "request",
     "Seconds a request spent waiting before its first schedule."),
    ("request_inference_time_seconds", "inference_time", "request",
     "Seconds from a request's first schedule to its last token."),
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
    ("request_max_num_generation_tokens", "max_num_generation_tokens", "tokens",
     "Tokens of the longest sequence per finished request."),
    ("request_params_n", "n", "n", "The n sampling parameter per finished request."),
    ("request_params_max_tokens", "max_tokens", "tokens",
     "The max_tokens sampling parameter per finished request."),
    ("request_prefill_kv_computed_tokens", "num_prefill_kv_computed_tokens", "tokens",
     "Prompt tokens whose KV was computed (not found in the prefix cache), per request."),
    ("request_num_preemptions", "num_preemptions", "preemptions",
     "Times a finished request was preempted (recomputed or swapped out), per request."),
)

# Per engine step, from IterationStats: (class, metric name, buckets key, help).
STEP_METRICS = (
    (Counter, "prompt_tokens", None, "Prefill tokens processed."),
    (Counter, "prompt_tokens_cached", None, "Prompt tokens found in the prefix cache."),
    (Counter, "generation_tokens", None, "Generation tokens processed."),
    (Histogram, "time_to_first_token_seconds", "ttft", "Time to first token in seconds."),
    (Histogram, "inter_token_latency_seconds", "token", "Seconds between consecutive tokens."),
    (Histogram, "iteration_tokens_total", "iteration",
     "Tokens per engine step: prompt tokens computed (not cached) + generated."),
)

# One extra label with a fixed set of values, each series exposed from the start:
# (class, metric name, label, values, help).
LABELLED = (
    (Counter, "request_success", "finished_reason", FINISH_REASONS,
     "Count of finished requests, by finish reason (stop, length, abort)."),
    (Gauge, "num_requests_waiting_by_reason", "reason", ("capacity", "deferred"),
     "Waiting requests by reason: 'capacity' waits for room; 'deferred' was skipped by "
     "the last admission pass (LoRA budget, grammar compiling, partial-prefill limit)."),
    (Gauge, "engine_sleep_state", "sleep_state", SLEEP_STATES,
     "Engine sleep state: awake = 1 when awake; weights_offloaded = 1 at sleep level 1 "
     "(weights in host memory), discard_all = 1 at level 2 (weights dropped)."),
    (Counter, "prompt_tokens_by_source", "source",
     ("local_compute", "local_cache_hit", "external_kv_transfer"),
     "Prompt tokens by source (there is no KV connector here: external_kv_transfer "
     "stays 0)."),
)
# fmt: on

GAUGES = (  # (metric name, SchedulerStats field, help)
    ("num_requests_running", "num_running", "Number of requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting (swapped included)."),
    ("num_requests_swapped", "num_swapped", "Number of requests swapped out to host memory."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage: 1 means 100 percent."),
    ("num_kv_cache_total_blocks", "num_kv_cache_total_blocks", "Usable KV-cache blocks."),
    ("num_prefix_cached_blocks", "num_prefix_cached_blocks", "Blocks in the prefix cache."),
    ("num_prefix_cached_tokens", "num_prefix_cached_tokens", "Tokens in the prefix cache."),
    ("prefix_cache_usage_perc", "prefix_cache_usage", "Prefix-cache share of the blocks (0-1)."),
)

CUMULATIVE_COUNTERS = (  # (metric name, SchedulerStats field, help)
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("mm_cache_queries", "mm_cache_queries", "Multi-modal cache queries, in images."),
    ("mm_cache_hits", "mm_cache_hits", "Multi-modal cache hits, in images (not encoded again)."),
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


def bucket_sets(max_model_len: int) -> dict[str, Sequence[float]]:
    """The buckets by the keys the tables use."""
    return {
        "ttft": TTFT_BUCKETS,
        "request": REQUEST_LATENCY_BUCKETS,
        "token": TOKEN_LATENCY_BUCKETS,
        "tokens": build_1_2_5_buckets(max_model_len),
        "iteration": ITERATION_TOKEN_BUCKETS,
        "n": N_BUCKETS,
        "preemptions": PREEMPTION_BUCKETS,
    }


SPEC_COUNTERS = (  # (metric name, SpecDecodingStats field, help)
    ("spec_decode_num_drafts", "num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Number of accepted tokens."),
)
LABELS = ("model_name", "engine")


class PrefixedCollector(Collector):
    """Every family of ``source`` once per prefix in ``prefixes``, in that order."""

    def __init__(
        self,
        source: CollectorRegistry,
        prefixes: Sequence[str] = PREFIXES,
        narrowed: Mapping[tuple[str, str], Sequence[str]] = VLLM_NARROWED,
    ) -> None:
        self.source = source
        self.prefixes = tuple(prefixes)
        self.narrowed = dict(narrowed)

    def collect(self) -> Iterator[Metric]:
        families = list(self.source.collect())  # one snapshot for every prefix
        for prefix in self.prefixes:
            for family in families:
                yield renamed(family, prefix, self.narrowed.get((prefix, family.name)))


def renamed(family: Metric, prefix: str, keep: Sequence[str] | None = None) -> Metric:
    """``family`` with ``prefix`` before its name and its samples' names; with
    ``keep``, only those labels, coinciding series merged to the largest value."""
    out = Metric(prefix + family.name, family.documentation, family.type, family.unit)
    if keep is None:
        out.samples = [s._replace(name=prefix + s.name) for s in family.samples]
        return out
    merged: dict[tuple, Any] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k in keep}
        key = (s.name, tuple(sorted(labels.items())))
        if key not in merged or s.value > merged[key].value:
            merged[key] = s._replace(name=prefix + s.name, labels=labels)
    out.samples = list(merged.values())
    return out


class AdmissionRejections(Collector):
    """vLLM's ``admission_rejections_total``: requests the engine front refused at a
    cap (``--max-num-queued-reqs``/``--max-num-queued-tokens``), one series per
    ``reason`` (the cap's name), read from the front's counts at each scrape, so every
    reason shows from the start, at 0. No ``engine`` label: with data parallelism one
    front checks for every replica."""

    def __init__(self, model_name: str, read: Callable[[], Mapping[str, int]]) -> None:
        self.model_name = model_name
        self.read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "admission_rejections",
            "Requests refused by admission control (HTTP 503), by the cap that fired.",
            labels=("model_name", "reason"),
        )
        for reason, count in sorted(self.read().items()):
            family.add_metric((self.model_name, reason), count)
        yield family


def cache_config_info(cache_config: Any, num_gpu_blocks: int, num_cpu_blocks: int) -> dict:
    """The labels of ``cache_config_info``, as vLLM's ``CacheConfig.metrics_info()``:
    every field of the (resolved) cache config as a string, under vLLM's field names,
    with the block counts the engine allocated (``num_cpu_blocks``: host blocks for
    swapping) and the swap space in bytes."""
    info = {
        CACHE_CONFIG_LABELS.get(f.name, f.name): str(getattr(cache_config, f.name))
        for f in dataclasses.fields(cache_config)
    }
    info["enable_prefix_caching"] = str(cache_config.enable_prefix_caching is not False)
    info["swap_space_bytes"] = str(int(cache_config.swap_space * (1 << 30)))
    info["num_gpu_blocks"] = str(num_gpu_blocks)
    info["num_cpu_blocks"] = str(num_cpu_blocks)
    return info


def engine_cache_config_info(engine: Any) -> dict:
    """`cache_config_info` of an `LLMEngine`, or of the first replica of a
    data-parallel engine (the replicas share one config)."""
    replica = getattr(engine, "replicas", [engine])[0]
    return cache_config_info(
        replica.config.cache_config,
        replica.kv_cache_size.num_blocks,
        replica.scheduler.limits.num_host_blocks,
    )
