"""A handler's result as the HTTP response every API route sends, with vLLM's ORCA
load header.

`respond`: a dict as JSON, anything else (an async iterator of server-sent events)
as a ``text/event-stream``. ORCA: a JSON response to a request with the
``endpoint-load-metrics-format`` header (``TEXT`` or ``JSON``) carries an
``endpoint-load-metrics`` header with the engine's load (`orca_header`), read from
``app.state.metrics``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("jaxengine.server")

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"
ORCA_METRICS = {  # Prometheus gauge -> ORCA named metric (vLLM's pair)
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:num_requests_waiting": "num_requests_waiting",
}


def orca_header(metrics_format: str, metrics: Any) -> dict[str, str] | None:
    """vLLM's ``endpoint-load-metrics`` header in ``metrics_format`` (TEXT or JSON),
    or None (no format asked for, or an unknown one).

    TEXT: ``TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=0.0``;
    JSON: ``JSON {"named_metrics": {...}}``. With several data-parallel replicas the
    waiting requests are summed and the KV-cache usage averaged.
    """
    if not metrics_format:
        return None
    kind = metrics_format.strip().lower()
    if kind not in ("text", "json"):
        logger.warning("%r format is not supported in the ORCA response header", metrics_format)
        return None
    named = _named_metrics(metrics)
    if kind == "text":
        pairs = ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())
        return {ORCA_HEADER: f"TEXT {pairs}"}
    return {ORCA_HEADER: f"JSON {json.dumps({'named_metrics': named})}"}


def _named_metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    values: dict[str, list[float]] = {}
    for family in metrics.registry.collect():
        name = ORCA_METRICS.get(family.name)
        if name is not None:
            values[name] = [float(s.value) for s in family.samples]
    out = {}
    for name, samples in values.items():
        total = sum(samples)
        out[name] = total / len(samples) if name == "kv_cache_usage_perc" and samples else total
    return out


def respond(result: Any, raw_request: Request | None = None) -> Response:
    """A handler's result as JSON (with the ORCA header when the request asks for it:
    the load comes from ``app.state.metrics``) or a stream."""
    if isinstance(result, dict):
        if raw_request is None or not raw_request.headers.get(ORCA_FORMAT_HEADER):
            return JSONResponse(result)
        metrics = getattr(raw_request.app.state, "metrics", None)
        wanted = raw_request.headers[ORCA_FORMAT_HEADER]
        return JSONResponse(result, headers=orca_header(wanted, metrics))
    return StreamingResponse(result, media_type="text/event-stream")
