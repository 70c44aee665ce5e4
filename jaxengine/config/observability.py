"""ObservabilityConfig: vLLM's observability flags that belong to the engine.

Only ``--show-hidden-metrics-for-version`` lives here: which of vLLM's deprecated,
hidden Prometheus families `metrics.PrometheusStatLogger` registers
(`metrics.hidden`). The tracing flags (``--otlp-traces-endpoint``,
``--collect-detailed-traces``) are the API server's (`server/tracing.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxengine.config.utils import validate_config

# A PEP 440 public version, as vLLM's check (packaging's `parse`) takes it, without
# the epoch: "0.11", "v0.10", "0.11.0rc1", "0.9.2.post1", "0.12.0.dev3+g1234abc".
_VERSION = re.compile(
    r"v?(\d+)(?:\.(\d+))?(?:\.\d+)*"
    r"(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?\d*)?"
    r"(?:[-_.]?dev[-_.]?\d*)?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?",
    re.IGNORECASE,
)


def release_of(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string ("0.11" and "v0.11.2rc1" -> (0, 11),
    "1" -> (1, 0)); ValueError when it is not a version."""
    match = _VERSION.fullmatch(version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a version; give a vLLM release such as 0.11")
    return int(match.group(1)), int(match.group(2) or 0)


@dataclass(frozen=True)
class ObservabilityConfig:
    """Configuration for observability: deprecated metrics kept for migrations."""

    show_hidden_metrics_for_version: str | None = None
    """Enable deprecated Prometheus metrics that have been hidden since the
    specified version. For example, if a previously deprecated metric has been
    hidden since the v0.7.0 release, you use `--show-hidden-metrics-for-version=0.7`
    as a temporary escape hatch while you migrate to new metrics. The metric is
    likely to be removed completely in an upcoming release. The version is a vLLM
    release, compared by major.minor; a metric shows for every version up to the one
    that hid it, so both the release that deprecated it (vLLM's rule: deprecated in
    X.Y, hidden from X.Y+1 unless given X.Y) and the one that hid it work. Up to 0.12:
    vllm:time_per_output_token_seconds (now vllm:inter_token_latency_seconds); up to
    0.11, also vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_queries and
    vllm:gpu_prefix_cache_hits (now vllm:kv_cache_usage_perc, vllm:prefix_cache_queries
    and vllm:prefix_cache_hits). A later version shows none, with a warning."""

    def __post_init__(self) -> None:
        validate_config(self)
        version = self.show_hidden_metrics_for_version
        if version is not None:
            try:
                release_of(version)
            except ValueError as e:
                raise ValueError(f"show_hidden_metrics_for_version: {e}") from None
