"""A tiny in-process OpenTelemetry collector for the tracing tests: it receives OTLP
trace exports over HTTP/protobuf (a `http.server` thread) or gRPC (a `grpc` server,
the package the gRPC exporter brings), decodes each ``ExportTraceServiceRequest``
with ``opentelemetry-proto`` and keeps its spans as plain `ReceivedSpan`s.

    with OtlpCollector("http/protobuf") as collector:
        ...  # export to collector.endpoint
        spans = collector.spans
"""

from __future__ import annotations

import dataclasses
import gzip
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

SPAN_KINDS = {
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
}


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    """One exported span as the collector decoded it (ids in lower-case hex)."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """"" for a root span."""
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]
    scope: str
    """The instrumentation scope's name."""


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """The spans of one export request."""
    spans = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        kind=SPAN_KINDS.get(span.kind, str(span.kind)),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_time_unix_nano=span.start_time_unix_nano,
                        end_time_unix_nano=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        scope=scope_spans.scope.name,
                    )
                )
    return spans


class OtlpCollector:
    """Receives OTLP trace exports on a free local port; ``protocol`` is "grpc" or
    "http/protobuf" (the values of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``)."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None

    def receive(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests += 1
            self.spans.extend(decode(request))

    def __enter__(self) -> OtlpCollector:
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def __exit__(self, *exc) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)

    def _start_http(self) -> None:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                collector.receive(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def _start_grpc(self) -> None:
        import grpc

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                collector.receive(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.endpoint = f"http://127.0.0.1:{port}"
