"""OpenTelemetry request spans: vLLM's ``--otlp-traces-endpoint`` and
``--collect-detailed-traces``.

With an endpoint, every engine request the server runs (completions, chat and the
APIs built over chat: Responses, Anthropic Messages, batch chat, /invocations; and
the pooling routes) is exported, when it finishes, as one span named
``llm_request`` of kind SERVER, as vLLM exports it: it starts at the request's
arrival in the engine and ends when its last output was made, its parent is the
W3C trace context the HTTP request carried (``traceparent``/``tracestate``), and its
attributes have vLLM's names (`SpanAttributes`). Values come from the finished
output's `RequestMetrics` (host timestamps, no JAX) and its sampling parameters. A
request left early (client gone, aborted by the server) has no finished output and
no span, as in vLLM; neither has a beam search, whose steps are many short engine
requests (`server/completions/beam.py`) and whose result carries no engine timings.

The exporter speaks OTLP over gRPC, or HTTP/protobuf with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` (vLLM's choice of protocols and
its default); the rest of the exporter's ``OTEL_*`` variables apply as usual.

Non-obvious choices:

- The trace context is request-scoped, so `TraceHeadersMiddleware` keeps the
  incoming trace headers in a `ContextVar` (as OpenTelemetry keeps its own current
  context) and `RequestTracer.watch` reads it when a handler queues its engine
  requests. Every API that reaches `ServingContext.streams` gets its parent that way,
  without a header argument threaded through each handler.
- Only the server traces: the offline `LLM` has no incoming trace context and no
  flag for it (vLLM's `LLM(otlp_traces_endpoint=...)` is an unknown argument here).
- The attribute names are spelt out, as vLLM spells them: the OpenTelemetry semantic
  conventions package defines only some of them, in its private ``_incubating``
  module, and marks ``gen_ai.usage.prompt_tokens``/``completion_tokens`` deprecated;
  tests/unit/test_server_tracing.py checks ours against the ones it defines.
- ``--collect-detailed-traces`` asks for values this engine does not measure (the
  device time of each forward pass, each step's execute time per request), so every
  value of it is refused at start-up (`check_tracing_args`) rather than answered
  with a made-up number. The span always has the host-measured prefill, decode and
  inference times that vLLM v1 reports.
- The OpenTelemetry packages are optional (``pip install 'jaxengine[otel]'``): this
  module imports them only when a tracer is built, and start-up fails naming them
  when the flag is given without them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from jaxengine.outputs import RequestMetrics, RequestOutput
from jaxengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxengine.inputs import PreparedPrompt

logger = logging.getLogger("jaxengine.server")

SPAN_NAME = "llm_request"
INSTRUMENTATION_NAME = "jaxengine.server"
TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context headers a span's parent is read from (vLLM's)."""
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
EXPORTER_MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
"""The OTLP protocols ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` may name (the first is
the default), and the module of each one's span exporter."""
DETAILED_TRACE_MODULES = ("model", "worker", "all")
INSTALL_HINT = (
    "pip install 'jaxengine[otel]' (or: pip install opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp)"
)
UNMEASURED = {
    "model": "gen_ai.latency.time_in_model_forward, the device time of the forward "
    "passes a request took part in, is not measured: jaxengine dispatches each step's "
    "jitted computation asynchronously and times no forward pass on the device",
    "worker": "gen_ai.latency.time_in_model_execute, the time of the model-execute "
    "calls a request took part in, is not measured: the engine does not attribute "
    "its steps' execute time to the requests in them",
}
"""Why each ``--collect-detailed-traces`` module's value cannot be reported."""


class SpanAttributes:
    """vLLM's span attribute names (``vllm/tracing.py``)."""

    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # named for --collect-detailed-traces, which is refused (`UNMEASURED`)
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


REQUEST_PARAMS = (
    (SpanAttributes.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
    (SpanAttributes.GEN_AI_REQUEST_TOP_P, "top_p"),
    (SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"),
    (SpanAttributes.GEN_AI_REQUEST_N, "n"),
)
"""Span attribute <- `SamplingParams` field."""


# ---------------------------------------------------------------------- flags


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's two tracing flags, in vLLM's ObservabilityConfig group (which
    `EngineArgs.add_cli_args` then adds ``--show-hidden-metrics-for-version`` to)."""
    group = parser.add_argument_group(
        "ObservabilityConfig", "OpenTelemetry request traces and deprecated metrics"
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="target URL of an OpenTelemetry collector: one span (llm_request) per "
        "finished request, with vLLM's gen_ai.* attributes, child of the request's "
        "traceparent header; OTLP over gRPC, or HTTP/protobuf with "
        f"{PROTOCOL_ENV}=http/protobuf (then the full URL, e.g. .../v1/traces). "
        "Needs the otel extra: pip install 'jaxengine[otel]'",
    )
    group.add_argument(
        "--collect-detailed-traces",
        type=_detailed_modules,
        nargs="+",
        default=None,
        metavar="MODULES",
        help="detailed traces of these modules (model, worker, all; comma-separated "
        "or several values); only meaningful with --otlp-traces-endpoint. Not "
        "supported yet: the engine measures neither value (refused at start-up)",
    )


def _detailed_modules(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in DETAILED_TRACE_MODULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r}: valid choices are {', '.join(DETAILED_TRACE_MODULES)}"
        )
    return names


def detailed_trace_modules(args: argparse.Namespace) -> list[str]:
    """The modules ``--collect-detailed-traces`` names, in order, each once."""
    groups = getattr(args, "collect_detailed_traces", None) or []
    return list(dict.fromkeys(name for group in groups for name in group))


def check_tracing_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> None:
    """ValueError before the engine loads: ``--collect-detailed-traces`` without
    ``--otlp-traces-endpoint`` (vLLM's message) or with a module whose value is not
    measured (`UNMEASURED`), and an endpoint without the OpenTelemetry packages or
    with an unknown ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``."""
    modules = detailed_trace_modules(args)
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if modules and not endpoint:
        raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
    if modules:
        wanted = UNMEASURED if "all" in modules else modules
        reasons = [UNMEASURED[module] for module in wanted]
        raise ValueError(
            f"--collect-detailed-traces {','.join(modules)} is not supported yet: "
            + "; ".join(reasons)
            + ". The llm_request span always carries the host-measured "
            "gen_ai.latency.time_in_model_prefill, _decode and _inference."
        )
    if endpoint:
        exporter_module(environ)


def exporter_module(environ: Mapping[str, str] = os.environ) -> Any:
    """The span exporter's module for ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (grpc
    by default); ValueError for another protocol or without the packages."""
    protocol = environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol not in EXPORTER_MODULES:
        raise ValueError(
            f"Unsupported OTLP protocol '{protocol}' is configured ({PROTOCOL_ENV}): "
            f"use {' or '.join(EXPORTER_MODULES)}"
        )
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        return importlib.import_module(EXPORTER_MODULES[protocol])
    except ImportError as e:
        raise ValueError(
            "OpenTelemetry is not available. Unable to configure 'otlp_traces_endpoint'. "
            f"Ensure OpenTelemetry packages are installed: {INSTALL_HINT}. "
            f"Original error: {e}"
        ) from None


# ---------------------------------------------------------------------- trace context

_TRACE_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar(
    "jaxengine_trace_headers", default=None
)
"""The trace headers of the HTTP request being handled (`TraceHeadersMiddleware`)."""


def trace_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The `TRACE_HEADERS` among ASGI headers (lower-case names, latin-1 values)."""
    wanted = {name.encode(): name for name in TRACE_HEADERS}
    return {wanted[k.lower()]: v.decode("latin-1") for k, v in raw if k.lower() in wanted}


def current_trace_headers() -> Mapping[str, str] | None:
    """The trace headers of the HTTP request this code runs for (None outside one)."""
    return _TRACE_HEADERS.get()


class TraceHeadersMiddleware:
    """Pure ASGI middleware: keeps each HTTP request's ``traceparent``/``tracestate``
    in a `ContextVar` while the app handles it (streamed bodies included), for
    `RequestTracer.watch`."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = _TRACE_HEADERS.set(trace_headers(scope["headers"]))
        try:
            return await self.app(scope, receive, send)
        finally:
            _TRACE_HEADERS.reset(token)


# ---------------------------------------------------------------------- spans


def span_attributes(output: RequestOutput, params: Any, model: str) -> dict[str, Any]:
    """A finished request's span attributes: the model, its engine request id, its
    sampling parameters (``params``: not set for a pooling request), its prompt and
    generated token counts (over all its sequences) and its latencies in seconds."""
    attributes: dict[str, Any] = {
        SpanAttributes.GEN_AI_RESPONSE_MODEL: model,
        SpanAttributes.GEN_AI_REQUEST_ID: output.request_id,
        SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids or ()),
    }
    if isinstance(params, SamplingParams):
        for name, field in REQUEST_PARAMS:
            value = getattr(params, field)
            if value is not None:
                attributes[name] = value
    metrics = output.metrics
    if metrics is not None:
        attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] = metrics.num_generation_tokens
        attributes.update(latency_attributes(metrics))
    return attributes


def latency_attributes(m: RequestMetrics) -> dict[str, float]:
    """vLLM's latencies from the engine's timestamps (those it has)."""
    spans = {
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: (m.arrival_time, m.first_scheduled_time),
        SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: (m.arrival_time, m.first_token_time),
        SpanAttributes.GEN_AI_LATENCY_E2E: (m.arrival_time, m.finished_time),
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: (
            m.first_scheduled_time,
            m.first_token_time,
        ),
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: (m.first_token_time, m.last_token_time),
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: (
            m.first_scheduled_time,
            m.last_token_time,
        ),
    }
    return {
        name: end - start
        for name, (start, end) in spans.items()
        if start is not None and end is not None
    }


class RequestTracer:
    """Exports one ``llm_request`` span per finished engine request through an
    OpenTelemetry ``TracerProvider`` (its span processors do the exporting)."""

    def __init__(self, provider: Any, model_name: str) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.model_name = model_name
        """``gen_ai.response.model`` of a request without a LoRA adapter."""
        self._tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    def watch(
        self, streams: Sequence[AsyncIterator[RequestOutput]], prepared: Sequence[PreparedPrompt]
    ) -> list[AsyncIterator[RequestOutput]]:
        """Each engine request's stream as it is, spanned when it finishes; the
        parent is the trace context of the HTTP request being handled now."""
        parent = self._propagator.extract(dict(current_trace_headers() or {}))
        return [
            self._watched(stream, prompt, parent)
            for stream, prompt in zip(streams, prepared, strict=True)
        ]

    async def _watched(
        self, stream: AsyncIterator[RequestOutput], prompt: PreparedPrompt, parent: Any
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for output in stream:
                if output.finished:
                    self.record(output, prompt, parent)
                yield output
        finally:
            await stream.aclose()

    def record(self, output: RequestOutput, prompt: PreparedPrompt, parent: Any) -> None:
        """Exports ``output``'s span: from its arrival to its finish (now, without
        engine timings), under ``parent`` (an OpenTelemetry context)."""
        lora = prompt.lora_request
        model = lora.lora_name if lora is not None else self.model_name
        metrics = output.metrics
        start = _nanoseconds(metrics.arrival_time) if metrics is not None else None
        end = None
        if metrics is not None and metrics.finished_time is not None:
            end = _nanoseconds(metrics.finished_time)
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._kind,
            attributes=span_attributes(output, prompt.params, model),
            start_time=start,
        )
        span.end(end_time=end)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Exports the spans still queued; False if that took too long."""
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter (at server shutdown)."""
        self.provider.shutdown()


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


def open_tracer(
    endpoint: str, model_name: str, environ: Mapping[str, str] = os.environ
) -> RequestTracer:
    """A `RequestTracer` exporting in batches to ``endpoint`` over the protocol of
    ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``; the provider is this server's own (the
    process's global tracer provider is left alone)."""
    exporter = exporter_module(environ).OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.info("exporting request traces to %s", endpoint)
    return RequestTracer(provider, model_name)


def request_tracer(args: Any, model_name: str) -> RequestTracer | None:
    """The tracer for ``--otlp-traces-endpoint``, or None without it."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    return open_tracer(endpoint, model_name) if endpoint else None
