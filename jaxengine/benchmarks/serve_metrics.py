"""The figures of the serving benchmark (`jaxengine.benchmarks.serve`) and vLLM's report block.

From per-request records and the run's wall time: request, output-token and
total-token throughput, and mean / median / std / chosen percentiles (in ms) of

- TTFT, time to the first chunk with text;
- TPOT, time per output token after the first: (E2EL - TTFT) / (output tokens - 1),
  over requests with at least two output tokens;
- ITL, the gaps between text chunks, pooled over all requests;
- E2EL, end-to-end latency.

Only successful requests count. Keys follow vLLM's result JSON (``mean_ttft_ms``,
``p99_itl_ms``, ``request_throughput``, ...); an empty series gives 0, as there.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxengine.benchmarks.serve_client import RequestResult

METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
"""Metric key -> (short name, section title) as in vLLM's report."""


def percentile_label(p: float) -> str:
    """``99`` -> "p99", ``99.9`` -> "p99.9" (vLLM's key names)."""
    return f"p{int(p)}" if p == int(p) else f"p{p}"


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)  # vLLM reports 0 for an empty series
    stats = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        stats[f"{percentile_label(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def aggregate(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    """The report's figures from per-request records and the run's wall time (s)."""
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens or 0 for r in ok)
    timed = [r for r in ok if r.ttft is not None]
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in timed
        if r.output_tokens is not None and r.output_tokens > 1
    ]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
    }
    metrics |= _stats("ttft", [r.ttft for r in timed], percentiles)
    metrics |= _stats("tpot", tpots, percentiles)
    metrics |= _stats("itl", [x for r in ok for x in r.itl], percentiles)
    metrics |= _stats("e2el", [r.latency for r in ok], percentiles)
    return metrics


def format_report(
    metrics: dict[str, Any],
    selected: list[str],
    percentiles: list[float],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
) -> str:
    """vLLM's "Serving Benchmark Result" block."""

    def row(label: str, value: Any) -> str:
        return f"{label:<40} {value}"

    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines += [row("Successful requests:", metrics["completed"])]
    lines += [row("Failed requests:", metrics["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(row("Request rate configured (RPS):", f"{request_rate:.2f}"))
    lines += [
        row("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
        row("Total input tokens:", metrics["total_input_tokens"]),
        row("Total generated tokens:", metrics["total_output_tokens"]),
        row("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        row("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        row("Total Token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    for key in selected:
        short, title = METRICS[key]
        lines.append(f"{title:-^50}")
        lines.append(row(f"Mean {short} (ms):", f"{metrics[f'mean_{key}_ms']:.2f}"))
        lines.append(row(f"Median {short} (ms):", f"{metrics[f'median_{key}_ms']:.2f}"))
        for p in percentiles:
            label = percentile_label(p)
            value = metrics[f"{label}_{key}_ms"]
            lines.append(row(f"{label.upper()} {short} (ms):", f"{value:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)
