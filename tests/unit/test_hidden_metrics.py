"""``--show-hidden-metrics-for-version``: vLLM's hidden deprecated metric families.

The flag parses, is validated (a bad version fails naming the flag) and reaches the
`EngineConfig`; with no version no hidden family is exposed; with one, the families
hidden at or after it appear under vLLM's names only, fed from the same stats as their
replacements.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.config.observability import ObservabilityConfig, release_of
from jaxengine.config.utils import field_docs
from jaxengine.core.sched_output import SchedulerStats
from jaxengine.engine_args import EngineArgs
from jaxengine.metrics.hidden import HIDDEN_FAMILIES, shown_families
from jaxengine.metrics.loggers import PrometheusStatLogger, render_metrics
from jaxengine.metrics.reader import get_metrics_snapshot
from jaxengine.metrics.stats import IterationStats

FLAG = "--show-hidden-metrics-for-version"
LABEL = {"model_name": "m", "engine": "0"}
GPU_NAMES = ("gpu_cache_usage_perc", "gpu_prefix_cache_queries", "gpu_prefix_cache_hits")
TPOT = "time_per_output_token_seconds"


def _parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="jaxengine test")
    EngineArgs.add_cli_args(parser)
    return parser


def _family_names(metrics: PrometheusStatLogger) -> set[str]:
    return {family.name for family in metrics.registry.collect()}


def _sample(metrics: PrometheusStatLogger, name: str, engine: str = "0") -> float | None:
    return metrics.registry.get_sample_value(name, {**LABEL, "engine": engine})


# ---- the flag ----------------------------------------------------------------------


def test_the_flag_parses_into_the_engine_config():
    args = EngineArgs.from_cli_args(_parser().parse_args([f"{FLAG}=0.11"]))
    assert args.show_hidden_metrics_for_version == "0.11"
    config = args.create_engine_config()
    assert config.observability_config.show_hidden_metrics_for_version == "0.11"
    assert EngineArgs().create_engine_config().observability_config == ObservabilityConfig()


@pytest.mark.parametrize("value", ["zero.eleven", "latest", "", "0.11-final", "1!0.11"])
def test_a_bad_version_fails_at_parse_time_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args([FLAG, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {FLAG}:" in err and "is not a version" in err


def test_a_bad_version_fails_from_python():
    with pytest.raises(ValueError, match="show_hidden_metrics_for_version: 'x' is not a"):
        EngineArgs(show_hidden_metrics_for_version="x")
    with pytest.raises(ValueError, match="show_hidden_metrics_for_version must be of type"):
        EngineArgs(show_hidden_metrics_for_version=0.11)
    with pytest.raises(ValueError, match="is not a version"):
        ObservabilityConfig(show_hidden_metrics_for_version="v")


@pytest.mark.parametrize(
    "text, release",
    [
        ("0.11", (0, 11)),
        ("v0.10", (0, 10)),
        (" 0.9.2 ", (0, 9)),
        ("0.11.0rc1", (0, 11)),
        ("0.9.2.post1", (0, 9)),
        ("0.12.0.dev3+g1234abc", (0, 12)),
        ("1", (1, 0)),
    ],
)
def test_release_of(text, release):
    assert release_of(text) == release


def test_the_help_names_every_hidden_family():
    help_text = field_docs(ObservabilityConfig)["show_hidden_metrics_for_version"]
    assert help_text.startswith("Enable deprecated Prometheus metrics that have been hidden")
    for family in HIDDEN_FAMILIES:
        assert f"vllm:{family.name}" in help_text, family.name


# ---- which families ------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, names",
    [
        (None, ()),
        ("0.9", (*GPU_NAMES, TPOT)),
        ("0.10", (*GPU_NAMES, TPOT)),  # vLLM 0.11's value for the gpu_* names
        ("0.11", (*GPU_NAMES, TPOT)),  # vLLM 0.12's for time_per_output_token
        ("0.11.2", (*GPU_NAMES, TPOT)),
        ("0.12", (TPOT,)),
        ("0.13", ()),
        ("1.0", ()),
    ],
)
def test_a_family_shows_up_to_the_release_that_hid_it(version, names):
    assert tuple(f.name for f in shown_families(version)) == names


def test_hidden_families_are_absent_by_default():
    metrics = PrometheusStatLogger("m")
    metrics.record(
        SchedulerStats(1, 0, 0, 0.5, 0, 10, 4), IterationStats(inter_token_latencies=[0.02])
    )
    body = render_metrics(metrics.registry)[0].decode()
    for name in (*GPU_NAMES, f"vllm:{TPOT}"):
        assert name not in body
    assert "vllm:kv_cache_usage_perc" in body  # the replacements are there


def test_the_flag_exposes_them_under_vllms_names_only():
    metrics = PrometheusStatLogger("m", show_hidden_metrics_for_version="0.10")
    names = _family_names(metrics)
    for name in (*GPU_NAMES, TPOT):
        assert f"vllm:{name}" in names
        assert f"jaxengine:{name}" not in names
    helps = {f.name: f.documentation for f in metrics.registry.collect()}
    assert "DEPRECATED: use vllm:kv_cache_usage_perc" in helps["vllm:gpu_cache_usage_perc"]
    later = _family_names(PrometheusStatLogger("m", show_hidden_metrics_for_version="0.12"))
    assert f"vllm:{TPOT}" in later and "vllm:gpu_cache_usage_perc" not in later


def test_a_version_that_shows_nothing_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxengine.metrics"):
        metrics = PrometheusStatLogger("m", show_hidden_metrics_for_version="0.13")
    assert f"{FLAG} 0.13 shows no metric" in caplog.text
    assert not any(n.startswith("vllm:gpu_") for n in _family_names(metrics))


# ---- values --------------------------------------------------------------------------


def test_hidden_families_read_their_replacements_stats():
    metrics = PrometheusStatLogger(
        "m", engine_indexes=range(2), show_hidden_metrics_for_version="0.10"
    )
    snapshots = [(0.5, 10, 4), (0.25, 30, 16), (0.75, 6, 2)]  # the last one: a reset
    for usage, queries, hits in snapshots:
        metrics.record(SchedulerStats(1, 0, 0, usage, 0, queries, hits), None)
    metrics.record(None, IterationStats(inter_token_latencies=[0.02, 0.3, 1.5]), engine_idx=1)
    for old, new in (
        ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("vllm:gpu_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    ):
        assert _sample(metrics, old) == _sample(metrics, new), old
    assert _sample(metrics, "vllm:gpu_cache_usage_perc") == 0.75
    assert _sample(metrics, "vllm:gpu_prefix_cache_queries_total") == 36
    assert _sample(metrics, "vllm:gpu_prefix_cache_hits_total", engine="1") == 0
    for suffix in ("_count", "_sum", '_bucket{le="0.5"}'):
        name, _, le = suffix.partition("{")
        labels = {**LABEL, "engine": "1", **({"le": "0.5"} if le else {})}
        tpot = metrics.registry.get_sample_value(f"vllm:{TPOT}{name}", labels)
        itl = metrics.registry.get_sample_value(f"vllm:inter_token_latency_seconds{name}", labels)
        assert tpot is not None and tpot == itl, suffix
    assert _sample(metrics, f"vllm:{TPOT}_count", engine="1") == 3


def test_get_metrics_reads_them():
    metrics = PrometheusStatLogger("m", show_hidden_metrics_for_version="0.11")
    metrics.record(
        SchedulerStats(0, 0, 0, 0.5, 0, 8, 2), IterationStats(inter_token_latencies=[0.1])
    )
    records = {r.name: r for r in get_metrics_snapshot(metrics.registry)}
    assert records["vllm:gpu_cache_usage_perc"].value == 0.5
    assert records["vllm:gpu_prefix_cache_hits"].value == 2
    assert records[f"vllm:{TPOT}"].count == 1


def test_the_engine_factory_passes_the_flag():
    from jaxengine.entrypoints.factory import prometheus_logger

    config = EngineArgs(show_hidden_metrics_for_version="0.11").create_engine_config()
    engine = SimpleNamespace(
        config=config,
        max_model_len=128,
        kv_cache_size=SimpleNamespace(num_blocks=8),
        scheduler=SimpleNamespace(limits=SimpleNamespace(num_host_blocks=0)),
    )
    metrics = prometheus_logger(engine, "m")
    assert {f"vllm:{TPOT}", "vllm:gpu_cache_usage_perc"} <= _family_names(metrics)
    plain = SimpleNamespace(**{**vars(engine), "config": EngineArgs().create_engine_config()})
    assert f"vllm:{TPOT}" not in _family_names(prometheus_logger(plain, "m"))
