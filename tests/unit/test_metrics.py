"""Prometheus metrics and the periodic log line, fed with synthetic engine stats."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.core.sched_output import SchedulerStats
from jaxengine.metrics.families import build_1_2_5_buckets
from jaxengine.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, render_metrics
from jaxengine.metrics.stats import FinishedRequestStats, IterationStats

MODEL = "SmolLM2-135M-Instruct"
LABEL = {"model_name": MODEL, "engine": "0"}


def sched(running=0, waiting=0, swapped=0, usage=0.0, preempt=0, queries=0, hits=0):
    return SchedulerStats(running, waiting, swapped, usage, preempt, queries, hits)


def finished(reason="stop", e2e=1.2, prompt=7, gen=5, max_tokens=16, n=1, cached=0):
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=e2e,
        num_prompt_tokens=prompt,
        num_generation_tokens=gen,
        max_tokens=max_tokens,
        queued_time=0.01,
        prefill_time=0.2,
        decode_time=1.0,
        time_per_output_token=0.25,
        n=n,
        max_num_generation_tokens=gen // n,
        num_cached_tokens=cached,
    )


def value(metrics: PrometheusStatLogger, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABEL, **labels})


# ---- Prometheus ------------------------------------------------------------------


def test_exposition_names_and_labels():
    metrics = PrometheusStatLogger(MODEL)
    metrics.record(sched(running=1), IterationStats(num_prompt_tokens=3))
    body, content_type = render_metrics(metrics.registry)
    assert content_type.startswith("text/plain")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    names = {name for name, labels in samples if ("model_name", MODEL) in labels}
    for name in (
        "jaxengine:num_requests_running",
        "jaxengine:num_requests_waiting",
        "jaxengine:num_requests_swapped",
        "jaxengine:kv_cache_usage_perc",
        "jaxengine:num_preemptions_total",
        "jaxengine:prompt_tokens_total",
        "jaxengine:generation_tokens_total",
        "jaxengine:prefix_cache_queries_total",
        "jaxengine:prefix_cache_hits_total",
        "jaxengine:time_to_first_token_seconds_bucket",
        "jaxengine:inter_token_latency_seconds_bucket",
        "jaxengine:e2e_request_latency_seconds_count",
        "jaxengine:request_queue_time_seconds_count",
        "jaxengine:request_prefill_time_seconds_count",
        "jaxengine:request_decode_time_seconds_count",
        "jaxengine:request_time_per_output_token_seconds_count",
        "jaxengine:request_prompt_tokens_count",
        "jaxengine:request_generation_tokens_count",
        "jaxengine:request_params_max_tokens_count",
        "jaxengine:iteration_tokens_total_count",
    ):
        assert name in names, name
    for reason in ("stop", "length", "abort"):
        key = (("engine", "0"), ("finished_reason", reason), ("model_name", MODEL))
        assert samples[("jaxengine:request_success_total", key)] == 0


def test_each_logger_owns_a_registry():
    a, b = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    assert a.registry is not b.registry
    shared = CollectorRegistry()
    assert PrometheusStatLogger("m", registry=shared).registry is shared


def test_gauges_follow_latest_snapshot():
    metrics = PrometheusStatLogger(MODEL)
    metrics.record(sched(running=4, waiting=2, swapped=1, usage=0.5), None)
    metrics.record(sched(running=3, waiting=0, swapped=0, usage=0.25), None)
    assert value(metrics, "jaxengine:num_requests_running") == 3
    assert value(metrics, "jaxengine:num_requests_waiting") == 0
    assert value(metrics, "jaxengine:num_requests_swapped") == 0
    assert value(metrics, "jaxengine:kv_cache_usage_perc") == 0.25


def test_cumulative_counters_become_deltas():
    metrics = PrometheusStatLogger(MODEL)
    for preempt, queries, hits in [(0, 10, 0), (2, 30, 16), (2, 30, 16), (5, 50, 32)]:
        metrics.record(sched(preempt=preempt, queries=queries, hits=hits), None)
    assert value(metrics, "jaxengine:num_preemptions_total") == 5
    assert value(metrics, "jaxengine:prefix_cache_queries_total") == 50
    assert value(metrics, "jaxengine:prefix_cache_hits_total") == 32
    # A drop means the source was reset: count the new value, never go down.
    metrics.record(sched(preempt=1, queries=4, hits=0), None)
    assert value(metrics, "jaxengine:num_preemptions_total") == 6
    assert value(metrics, "jaxengine:prefix_cache_queries_total") == 54
    assert value(metrics, "jaxengine:prefix_cache_hits_total") == 32


def test_token_counters_and_step_histograms():
    metrics = PrometheusStatLogger(MODEL)
    metrics.record(
        sched(),
        IterationStats(
            num_prompt_tokens=12, num_generation_tokens=2, time_to_first_tokens=[0.03, 0.3]
        ),
    )
    metrics.record(
        sched(), IterationStats(num_generation_tokens=2, inter_token_latencies=[0.02, 0.04])
    )
    assert value(metrics, "jaxengine:prompt_tokens_total") == 12
    assert value(metrics, "jaxengine:generation_tokens_total") == 4
    ttft = "jaxengine:time_to_first_token_seconds"
    assert value(metrics, f"{ttft}_count") == 2
    assert value(metrics, f"{ttft}_sum") == pytest.approx(0.33)
    assert value(metrics, f"{ttft}_bucket", le="0.04") == 1
    assert value(metrics, f"{ttft}_bucket", le="+Inf") == 2
    assert value(metrics, "jaxengine:inter_token_latency_seconds_count") == 2
    steps = "jaxengine:iteration_tokens_total"
    assert value(metrics, f"{steps}_count") == 2
    assert value(metrics, f"{steps}_sum") == 16
    assert value(metrics, f"{steps}_bucket", le="8.0") == 1  # vLLM's buckets: 1, 8, 16, ...


def test_finished_requests_by_reason_and_histograms():
    metrics = PrometheusStatLogger(MODEL, max_model_len=1000)
    stats = IterationStats(
        finished_requests=[finished("stop"), finished("length", max_tokens=None)],
        num_aborted=2,
    )
    metrics.record(sched(), stats)
    metrics.record(None, IterationStats(finished_requests=[finished("stop", e2e=3.0)]))
    success = "jaxengine:request_success_total"
    assert value(metrics, success, finished_reason="stop") == 2
    assert value(metrics, success, finished_reason="length") == 1
    assert value(metrics, success, finished_reason="abort") == 2
    e2e = "jaxengine:e2e_request_latency_seconds"
    assert value(metrics, f"{e2e}_count") == 3
    assert value(metrics, f"{e2e}_sum") == pytest.approx(5.4)
    assert value(metrics, f"{e2e}_bucket", le="1.5") == 2
    for name in ("queue_time", "prefill_time", "decode_time", "time_per_output_token"):
        assert value(metrics, f"jaxengine:request_{name}_seconds_count") == 3
    assert value(metrics, "jaxengine:request_prompt_tokens_sum") == 21
    assert value(metrics, "jaxengine:request_generation_tokens_bucket", le="5.0") == 3
    # max_tokens=None is not observed; token buckets stop at max_model_len.
    assert value(metrics, "jaxengine:request_params_max_tokens_count") == 2
    assert value(metrics, "jaxengine:request_params_max_tokens_bucket", le="1000.0") == 2
    assert value(metrics, "jaxengine:request_params_max_tokens_bucket", le="2000.0") is None


def test_record_from_several_threads():
    metrics = PrometheusStatLogger(MODEL)
    log = LoggingStatLogger(interval=1.0, clock=lambda: 0.0)

    def engine_thread() -> None:
        for _ in range(200):
            stats = IterationStats(num_generation_tokens=1, inter_token_latencies=[0.01])
            metrics.record(sched(running=1), stats)
            log.record(sched(running=1), stats)

    threads = [threading.Thread(target=engine_thread) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert value(metrics, "jaxengine:generation_tokens_total") == 800
    assert value(metrics, "jaxengine:inter_token_latency_seconds_count") == 800
    assert log.log(now=2.0).startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 400.0 tokens/s"
    )


def test_data_parallel_engines_are_labelled_apart():
    metrics = PrometheusStatLogger(MODEL, engine_indexes=range(2))
    metrics.for_engine(0).record(sched(running=2), IterationStats(num_generation_tokens=3))
    metrics.for_engine(1).record(
        sched(running=1, queries=16), IterationStats(finished_requests=[finished("length")])
    )
    metrics.record(None, IterationStats(num_generation_tokens=4), engine_idx=1)
    assert value(metrics, "jaxengine:num_requests_running") == 2
    assert value(metrics, "jaxengine:num_requests_running", engine="1") == 1
    assert value(metrics, "jaxengine:generation_tokens_total") == 3
    assert value(metrics, "jaxengine:generation_tokens_total", engine="1") == 4
    assert value(metrics, "jaxengine:prefix_cache_queries_total", engine="1") == 16
    assert value(metrics, "jaxengine:request_success_total", finished_reason="length") == 0
    assert (
        value(metrics, "jaxengine:request_success_total", engine="1", finished_reason="length") == 1
    )
    with pytest.raises(ValueError, match="engine 2 is not one of"):
        metrics.for_engine(2)
    body, _ = render_metrics(metrics.registry)
    assert 'engine="1"' in body.decode()


def test_engine_prefix_on_the_log_line():
    log = LoggingStatLogger(interval=1.0, clock=lambda: 0.0, engine_index=1)
    log.record(sched(running=1), IterationStats(num_generation_tokens=5))
    assert log.log(now=1.0).startswith("Engine 001: Avg prompt throughput: 0.0 tokens/s")


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192)[-1] == 5000
    assert build_1_2_5_buckets(1) == [1]


def test_import_leaves_jax_out():
    code = "import sys, jaxengine.metrics.loggers; print([m for m in ('jax', 'torch') if m in sys.modules])"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- vLLM's names: both prefixes, vLLM's label sets ----------------------------


def families(metrics: PrometheusStatLogger) -> dict:
    body, _ = render_metrics(metrics.registry)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_every_family_under_both_prefixes_from_one_source():
    """vLLM's docs: metrics "are exposed via the /metrics endpoint ... using the vllm:
    prefix". Each family is also exposed as jaxengine:*, with the same samples."""
    metrics = PrometheusStatLogger(MODEL, engine_indexes=range(2))
    metrics.record(sched(running=2, queries=32, hits=16), IterationStats(num_prompt_tokens=9))
    metrics.record(None, IterationStats(finished_requests=[finished()]), engine_idx=1)
    exposed = families(metrics)
    vllm = {name[len("vllm:") :]: f for name, f in exposed.items() if name.startswith("vllm:")}
    ours = {n[len("jaxengine:") :]: f for n, f in exposed.items() if n.startswith("jaxengine:")}
    assert len(exposed) == len(vllm) + len(ours) and vllm.keys() == ours.keys()
    for name, family in vllm.items():
        assert family.type == ours[name].type, name
        strip = [(s.name.split(":", 1)[1], s.labels, s.value) for s in family.samples]
        assert strip == [(s.name.split(":", 1)[1], s.labels, s.value) for s in ours[name].samples]
    assert value(metrics, "vllm:prefix_cache_hits_total") == 16
    assert value(metrics, "vllm:request_success_total", engine="1", finished_reason="stop") == 1


def test_new_vllm_series_from_the_stats():
    """vLLM's num_requests_waiting_by_reason ("Sum of all reasons equals
    vllm:num_requests_waiting"), prompt_tokens_by_source / prompt_tokens_cached,
    iteration_tokens_total over computed tokens, and the per-request histograms
    request_inference_time_seconds, request_params_n,
    request_max_num_generation_tokens and request_prefill_kv_computed_tokens."""
    metrics = PrometheusStatLogger(MODEL)
    stats = SchedulerStats(0, 5, 0, 0.0, 0, 0, 0, num_deferred=2)
    step = IterationStats(
        num_prompt_tokens=20,
        num_cached_prompt_tokens=16,
        num_generation_tokens=3,
        finished_requests=[finished(prompt=20, gen=6, n=2, cached=16), finished(gen=4)],
    )
    metrics.record(stats, step)
    assert value(metrics, "vllm:num_requests_waiting") == 5
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2
    assert value(metrics, "vllm:prompt_tokens_total") == 20
    assert value(metrics, "vllm:prompt_tokens_cached_total") == 16
    by_source = "vllm:prompt_tokens_by_source_total"
    assert value(metrics, by_source, source="local_compute") == 4
    assert value(metrics, by_source, source="local_cache_hit") == 16
    assert value(metrics, by_source, source="external_kv_transfer") == 0
    assert value(metrics, "vllm:iteration_tokens_total_sum") == 4 + 3
    assert value(metrics, "vllm:request_inference_time_seconds_sum") == pytest.approx(2 * 1.2)
    assert value(metrics, "vllm:request_params_n_sum") == 3
    assert value(metrics, "vllm:request_params_n_bucket", le="2.0") == 2
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum") == 3 + 4
    assert value(metrics, "vllm:request_generation_tokens_sum") == 6 + 4
    assert value(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == (20 - 16) + 7


def test_prefix_cache_gauges_and_preemptions_per_request():
    """vLLM's prefix-cache state gauges (``num_kv_cache_total_blocks``,
    ``num_prefix_cached_blocks`` / ``_tokens``, ``prefix_cache_usage_perc``) and the
    ``request_num_preemptions`` histogram (vLLM's buckets 1, 2, 3, 4, 5, 10, 20; a
    request never preempted is observed at 0)."""
    metrics = PrometheusStatLogger(MODEL)
    stats = dataclasses.replace(
        sched(),
        num_kv_cache_total_blocks=40,
        num_prefix_cached_blocks=10,
        num_prefix_cached_tokens=160,
    )
    preempted = [dataclasses.replace(finished(), num_preemptions=k) for k in (0, 1, 3, 12)]
    metrics.record(stats, IterationStats(finished_requests=preempted))
    assert value(metrics, "vllm:num_kv_cache_total_blocks") == 40
    assert value(metrics, "vllm:num_prefix_cached_blocks") == 10
    assert value(metrics, "vllm:num_prefix_cached_tokens") == 160
    assert value(metrics, "vllm:prefix_cache_usage_perc") == 0.25
    histogram = "vllm:request_num_preemptions"
    assert value(metrics, f"{histogram}_count") == 4
    assert value(metrics, f"{histogram}_sum") == 16
    buckets = {le: value(metrics, f"{histogram}_bucket", le=le) for le in ("1.0", "3.0", "20.0")}
    assert buckets == {"1.0": 2, "3.0": 3, "20.0": 4}
    assert value(metrics, f"{histogram}_bucket", le="+Inf") == 4
    assert value(metrics, "jaxengine:request_num_preemptions_sum") == 16


def test_data_parallel_prefix_cache_usage_is_over_all_blocks():
    """A data-parallel engine sums its replicas' blocks; the usage is the share of
    all of them (not an average of shares)."""
    from jaxengine.engine.data_parallel import DataParallelEngine

    replicas = [
        SimpleNamespace(get_stats=lambda b=blocks: dataclasses.replace(sched(), **b))
        for blocks in (
            dict(num_kv_cache_total_blocks=10, num_prefix_cached_blocks=5),
            dict(num_kv_cache_total_blocks=30, num_prefix_cached_blocks=3),
        )
    ]
    engine = SimpleNamespace(replicas=replicas)
    total = DataParallelEngine.get_stats(engine)
    assert (total.num_kv_cache_total_blocks, total.num_prefix_cached_blocks) == (40, 8)
    assert total.prefix_cache_usage == 0.2


def test_scheduler_reports_deferred_requests():
    """A waiting request the admission pass skips (here: over the LoRA budget) is
    vLLM's "deferred"; the rest of the queue waits for "capacity"."""
    from types import SimpleNamespace

    from jaxengine.core import Request, Scheduler, SchedulerLimits
    from jaxengine.lora.request import LoRARequest

    limits = SchedulerLimits(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_blocks=33, max_loras=1
    )
    scheduler = Scheduler(limits)
    params = SimpleNamespace(max_tokens=4)
    for i, lora in enumerate([LoRARequest("a", 1), LoRARequest("b", 2), None, None]):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], params, lora_request=lora))
    scheduler.schedule()  # r0 (adapter a) and r2 run; r1 (adapter b) is skipped
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_deferred) == (2, 2, 1)
    metrics = PrometheusStatLogger(MODEL)
    metrics.record(stats, None)
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1


def test_lora_requests_info_has_vllms_labels_under_vllm():
    """vLLM's lora_requests_info is labelled max_lora, waiting_lora_adapters and
    running_lora_adapters only; jaxengine:lora_requests_info keeps model_name and
    engine. Engines with the same adapters share one vllm: series (the latest time)."""
    metrics = PrometheusStatLogger(MODEL, engine_indexes=range(2))
    lora = SchedulerStats(1, 0, 0, 0.0, 0, 0, 0, {"a": 1}, {}, 2)
    metrics.record(lora, None, engine_idx=0)
    metrics.record(lora, None, engine_idx=1)
    exposed = families(metrics)
    [series] = exposed["vllm:lora_requests_info"].samples
    labels = {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": "a"}
    assert series.labels == labels
    ours = exposed["jaxengine:lora_requests_info"].samples
    assert sorted(s.labels["engine"] for s in ours) == ["0", "1"]
    assert series.value == max(s.value for s in ours)


def test_spec_decode_families_under_vllm_names():
    from jaxengine.core.sched_output import SpecDecodingStats

    metrics = PrometheusStatLogger(MODEL)
    spec = SpecDecodingStats(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=5)
    spec = dataclasses.replace(spec, accepted_per_pos=(3, 2))
    metrics.record(SchedulerStats(1, 0, 0, 0.0, 0, 0, 0, spec_decoding=spec), None)
    exposed = families(metrics)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        family = exposed[f"vllm:spec_decode_{name}"]
        assert family.type == "counter" and set(family.samples[0].labels) == set(LABEL)
    per_pos = exposed["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {s.labels["position"]: s.value for s in per_pos if s.name.endswith("_total")} == {
        "0": 3,
        "1": 2,
    }


def test_cache_config_info():
    """vLLM's cache_config_info: a gauge set to 1 per engine, labelled with the cache
    config (vLLM's field names: cache_dtype) and the engine, without model_name."""
    from jaxengine.config.cache import CacheConfig
    from jaxengine.metrics.families import cache_config_info

    config = CacheConfig(block_size=16, kv_cache_dtype="fp8", swap_space=1)
    info = cache_config_info(config, num_gpu_blocks=100, num_cpu_blocks=8)
    metrics = PrometheusStatLogger(MODEL, engine_indexes=range(2), cache_config_info=info)
    samples = families(metrics)["vllm:cache_config_info"].samples
    assert sorted(s.labels["engine"] for s in samples) == ["0", "1"]
    for s in samples:
        assert s.value == 1 and "model_name" not in s.labels
        assert s.labels["block_size"] == "16" and s.labels["cache_dtype"] == "fp8"
        assert s.labels["enable_prefix_caching"] == "True"  # unset means on
        assert (s.labels["num_gpu_blocks"], s.labels["num_cpu_blocks"]) == ("100", "8")
        assert s.labels["swap_space_bytes"] == str(1 << 30)


def test_get_metrics_reads_vllm_names():
    """LLM.get_metrics() (metrics_reader) as vLLM's reader: records named vllm:*."""
    from jaxengine.metrics.reader import Counter as ReaderCounter
    from jaxengine.metrics.reader import get_metrics_snapshot

    metrics = PrometheusStatLogger(MODEL)
    metrics.record(sched(), IterationStats(num_generation_tokens=7))
    snapshot = {(m.name, type(m).__name__) for m in get_metrics_snapshot(metrics.registry)}
    assert ("vllm:generation_tokens", "Counter") in snapshot
    assert ("jaxengine:generation_tokens", "Counter") in snapshot
    assert ("vllm:time_to_first_token_seconds", "Histogram") in snapshot
    [gen] = [
        m
        for m in get_metrics_snapshot(metrics.registry)
        if m.name == "vllm:generation_tokens" and isinstance(m, ReaderCounter)
    ]
    assert gen.value == 7 and gen.labels == LABEL


# ---- the log line ----------------------------------------------------------------


@pytest.fixture
def caplog_info(caplog):
    caplog.set_level(logging.INFO, logger="jaxengine.metrics")
    return caplog


def test_log_line_content(caplog_info):
    log = LoggingStatLogger(interval=10.0, clock=lambda: 0.0)
    log.record(sched(queries=100, hits=40), None)  # before the window: 40% so far
    assert log.log(now=10.0) is None  # idle: nothing running, no tokens
    log.record(sched(running=2, waiting=1, usage=0.125, queries=100, hits=40), None)
    log.record(None, IterationStats(num_prompt_tokens=200, num_generation_tokens=30))
    log.record(
        sched(running=2, waiting=1, usage=0.125, queries=200, hits=115),
        IterationStats(num_generation_tokens=20),
    )
    assert log.log(now=15.0) is None  # less than `interval` since the last call
    line = log.log(now=20.0)
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 75.0%"
    )
    assert [r.getMessage() for r in caplog_info.records] == [line]
    assert caplog_info.records[0].levelno == logging.INFO


def test_log_keeps_reporting_while_busy(caplog_info):
    log = LoggingStatLogger(interval=5.0, clock=lambda: 0.0)
    log.record(sched(waiting=3, swapped=1), None)
    first = log.log(now=5.0)
    assert "Avg prompt throughput: 0.0 tokens/s" in first
    assert "Waiting: 3 reqs" in first and first.endswith("Swapped: 1 reqs")
    assert "Prefix cache hit rate: 0.0%" in first
    assert log.log(now=10.0) is not None  # still waiting: keep a line per interval
    assert len(caplog_info.records) == 2


def test_log_quiet_when_idle(caplog_info):
    times = iter([0.0, 30.0, 60.0, 90.0])
    log = LoggingStatLogger(interval=10.0, clock=lambda: next(times))
    log.record(sched(running=1), IterationStats(num_generation_tokens=60))
    assert (
        log.log() == "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
        "2.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 0.0%"
    )
    log.record(sched(), IterationStats(num_generation_tokens=0))  # drained
    assert log.log() is None
    assert log.log() is None
    assert len(caplog_info.records) == 1


def test_log_after_idle_rates_use_window_since_last_call(caplog_info):
    log = LoggingStatLogger(interval=10.0, clock=lambda: 0.0)
    assert log.log(now=100.0) is None  # idle window dropped
    log.record(sched(), IterationStats(num_prompt_tokens=50, finished_requests=[finished()]))
    line = log.log(now=110.0)
    assert line is not None and line.startswith("Avg prompt throughput: 5.0 tokens/s")
