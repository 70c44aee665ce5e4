"""``/metrics`` under vLLM's series names, types and label sets.

vLLM's docs (Production Metrics; design doc "Metrics"): "vLLM exposes a number of
metrics that can be used to monitor the health of the system. These metrics are
exposed via the /metrics endpoint on the vLLM OpenAI compatible API server", "using
the ``vllm:`` prefix", and "In vLLM, we add a model_name label to every metric"
(with an ``engine`` label per engine core). The same families stay exposed as
``jaxengine:*``: one set of samples under both prefixes.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL
from tests.server.test_endpoints import wait_for

ENGINE = ("model_name", "engine")

# vLLM's series, written from vLLM v1's `PrometheusStatLogger`
# (vllm/v1/metrics/loggers.py) and its test list (EXPECTED_METRICS_V1 in
# tests/entrypoints/openai/test_metrics.py): family name as the exposition's "# TYPE"
# line gives it (a counter's without "_total") -> (type, label names). Only the series
# a default vLLM server exposes for the features this engine has; LoRA's and
# speculative decoding's families are checked in tests/unit/test_metrics.py.
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", ENGINE),
    "vllm:num_requests_waiting": ("gauge", ENGINE),
    "vllm:num_requests_waiting_by_reason": ("gauge", (*ENGINE, "reason")),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE),
    "vllm:prefix_cache_queries": ("counter", ENGINE),
    "vllm:prefix_cache_hits": ("counter", ENGINE),
    "vllm:num_preemptions": ("counter", ENGINE),
    "vllm:prompt_tokens": ("counter", ENGINE),
    "vllm:prompt_tokens_by_source": ("counter", (*ENGINE, "source")),
    "vllm:prompt_tokens_cached": ("counter", ENGINE),
    "vllm:generation_tokens": ("counter", ENGINE),
    "vllm:request_success": ("counter", (*ENGINE, "finished_reason")),
    "vllm:request_prompt_tokens": ("histogram", ENGINE),
    "vllm:request_generation_tokens": ("histogram", ENGINE),
    "vllm:iteration_tokens_total": ("histogram", ENGINE),
    "vllm:request_max_num_generation_tokens": ("histogram", ENGINE),
    "vllm:request_params_n": ("histogram", ENGINE),
    "vllm:request_params_max_tokens": ("histogram", ENGINE),
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE),
    "vllm:request_time_per_output_token_seconds": ("histogram", ENGINE),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE),
    "vllm:request_queue_time_seconds": ("histogram", ENGINE),
    "vllm:request_inference_time_seconds": ("histogram", ENGINE),
    "vllm:request_prefill_time_seconds": ("histogram", ENGINE),
    "vllm:request_decode_time_seconds": ("histogram", ENGINE),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ENGINE),
    "vllm:request_num_preemptions": ("histogram", ENGINE),
    "vllm:num_kv_cache_total_blocks": ("gauge", ENGINE),
    "vllm:num_prefix_cached_blocks": ("gauge", ENGINE),
    "vllm:num_prefix_cached_tokens": ("gauge", ENGINE),
    "vllm:prefix_cache_usage_perc": ("gauge", ENGINE),
    # vLLM v0's (the design doc's "KV Cache Offloading"): requests swap out here
    "vllm:num_requests_swapped": ("gauge", ENGINE),
}
# vllm:cache_config_info: "a Gauge metric set to 1", labelled with the CacheConfig
# (these are the labels vLLM's test list names) and the engine; no model_name.
CACHE_CONFIG_LABELS = {
    "engine",
    "block_size",
    "cache_dtype",
    "cpu_offload_gb",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "num_cpu_blocks",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "swap_space_bytes",
}
# The extra label's values vLLM exposes from the start (at 0), for the label values
# that exist here: finish reasons, waiting reasons, prompt-token sources.
LABEL_VALUES = {
    "vllm:request_success": ("finished_reason", {"stop", "length", "abort"}),
    "vllm:num_requests_waiting_by_reason": ("reason", {"capacity", "deferred"}),
    "vllm:prompt_tokens_by_source": (
        "source",
        {"local_compute", "local_cache_hit", "external_kv_transfer"},
    ),
}


# vLLM's admission-control counter (--max-num-queued-reqs/-tokens): the API server's,
# not an engine's, so labelled by model and the cap that fired (vLLM's field name), no
# engine label; every reason exposed from the start, at 0 (no cap is set here).
ADMISSION = ("vllm:admission_rejections", {"max_num_queued_reqs", "max_num_queued_tokens"})


def families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # two full 16-token blocks


def complete(server, max_tokens: int, n: int = 1) -> None:
    out = server.client(max_retries=0, timeout=120).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        n=n,
        temperature=0 if n == 1 else 1.0,  # vLLM refuses n > 1 with greedy sampling
        seed=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == n * max_tokens


def test_vllm_series_names_types_and_labels(server):
    complete(server, max_tokens=3)
    exposed = families(server)
    for name, (kind, labels) in VLLM_SERIES.items():
        assert name in exposed, name
        family = exposed[name]
        assert family.type == kind, (name, family.type)
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        assert samples, name
        for sample in samples:
            names = set(sample.labels) - {"le"}  # a histogram's buckets add "le"
            assert names == set(labels), (name, sample.labels)
            assert sample.labels["model_name"] == MODEL
        engines = {s.labels["engine"] for s in samples}
        assert engines == {str(i) for i in range(server.data_parallel_size)}, name
    for name, (label, values) in LABEL_VALUES.items():
        assert {s.labels[label] for s in exposed[name].samples} == values, name
    info = exposed["vllm:cache_config_info"]
    assert info.type == "gauge"
    assert len(info.samples) == server.data_parallel_size  # one series per engine
    for sample in info.samples:
        assert CACHE_CONFIG_LABELS <= set(sample.labels) and "model_name" not in sample.labels
        assert sample.value == 1
        assert sample.labels["block_size"] == "16"
        assert sample.labels["enable_prefix_caching"] == "True"
        assert int(sample.labels["num_gpu_blocks"]) > 0


def test_admission_rejections_from_the_start(server):
    name, reasons = ADMISSION
    family = families(server)[name]
    assert family.type == "counter"
    assert {s.labels["reason"]: s.value for s in family.samples} == dict.fromkeys(reasons, 0)
    for sample in family.samples:  # one series per reason, whatever the replica count
        assert sample.name == f"{name}_total"
        assert set(sample.labels) == {"model_name", "reason"}
        assert sample.labels["model_name"] == MODEL


def test_both_prefixes_expose_the_same_samples(server):
    complete(server, max_tokens=2)
    text = server.get("/metrics").text
    by_prefix: dict[str, dict] = {"vllm:": {}, "jaxengine:": {}}
    for family in text_string_to_metric_families(text):
        prefix = family.name.split(":", 1)[0] + ":"
        if prefix in by_prefix:
            for s in family.samples:
                key = (s.name.split(":", 1)[1], tuple(sorted(s.labels.items())))
                by_prefix[prefix][key] = s.value
    assert by_prefix["vllm:"]  # the scrape is one snapshot: both halves agree exactly
    assert by_prefix["vllm:"] == by_prefix["jaxengine:"]


def test_vllm_counts_after_traffic(server):
    """As vLLM's test_metrics_counts: per finished request one observation of each
    request histogram, ``request_params_n`` of its n, ``request_generation_tokens``
    and ``request_params_max_tokens`` summing to the tokens asked for."""
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert wait_for(lambda: all(server.metrics()[name] == 0 for name in idle))
    before = server.metrics()
    complete(server, max_tokens=4)
    complete(server, max_tokens=3, n=2)

    def delta(name: str) -> float:
        return server.metrics().get(name, 0.0) - before.get(name, 0.0)

    assert wait_for(lambda: delta("vllm:request_success_total") == 2)
    assert delta("vllm:generation_tokens_total") == 4 + 2 * 3
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_prefill_kv_computed_tokens",
        "request_num_preemptions",  # (0 here: the shared server's cache is large)
    ):
        assert delta(f"vllm:{name}_count") == 2, name
    assert delta("vllm:request_params_n_sum") == 1 + 2
    assert delta("vllm:request_params_max_tokens_sum") == 4 + 3
    assert delta("vllm:request_generation_tokens_sum") == 4 + 2 * 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4 + 3
    # prompt tokens: each one was computed or found in the prefix cache
    prompt = delta("vllm:prompt_tokens_total")
    source = 'vllm:prompt_tokens_by_source_total{{model_name="{}",source="{}"}}'
    computed = delta(source.format(MODEL, "local_compute"))
    cached = delta(source.format(MODEL, "local_cache_hit"))
    assert prompt > 0 and computed + cached == prompt
    if server.data_parallel_size == 1:  # the second request found the first's blocks
        assert cached >= 16
    assert delta(source.format(MODEL, "external_kv_transfer")) == 0
    assert delta("vllm:prompt_tokens_cached_total") == cached
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == computed
    # the steps' tokens: the prompt tokens computed plus those generated
    assert delta("vllm:iteration_tokens_total_sum") == computed + 4 + 2 * 3
    after = server.metrics()
    # the prompt's two full blocks stay in the prefix cache (vLLM's state gauges)
    assert after["vllm:num_prefix_cached_blocks"] >= 2
    assert after["vllm:num_prefix_cached_tokens"] == 16 * after["vllm:num_prefix_cached_blocks"]
    check_prefix_cache_gauges(families(server))
    waiting = 'vllm:num_requests_waiting_by_reason{{model_name="{}",reason="{}"}}'
    by_reason = sum(after[waiting.format(MODEL, r)] for r in ("capacity", "deferred"))
    assert by_reason == after["vllm:num_requests_waiting"]


def check_prefix_cache_gauges(exposed: dict) -> None:
    """Per engine: the usable blocks are cache_config_info's less the null block, and
    the prefix cache's usage is its blocks' share of them."""

    def per_engine(name: str) -> dict[str, float]:
        return {s.labels["engine"]: s.value for s in exposed[name].samples}

    allocated = {
        s.labels["engine"]: int(s.labels["num_gpu_blocks"])
        for s in exposed["vllm:cache_config_info"].samples
    }
    total = per_engine("vllm:num_kv_cache_total_blocks")
    cached = per_engine("vllm:num_prefix_cached_blocks")
    usage = per_engine("vllm:prefix_cache_usage_perc")
    assert total == {engine: blocks - 1 for engine, blocks in allocated.items()}
    for engine, blocks in total.items():
        assert usage[engine] == cached[engine] / blocks
