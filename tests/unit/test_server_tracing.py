"""OpenTelemetry request spans (``--otlp-traces-endpoint``) without a model: the flags
and their refusals, the attributes from an output's timings, and spans exported from
the app over a fake engine to an in-process OTLP collector (`tests.otlp_collector`)
over both protocols. The same over the real tiny engine, chat and the Responses API
included: tests/engine/test_request_traces.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from jaxengine.config import MultiModalConfig
from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from server.api_server.args import add_server_args, check_server_args
from server.tracing import (
    PROTOCOL_ENV,
    SpanAttributes,
    check_tracing_args,
    span_attributes,
)
from tests.otlp_collector import OtlpCollector

A = SpanAttributes
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ARRIVAL = 1000.0
TIMES = dict(first_scheduled_time=1000.25, first_token_time=1000.5, last_token_time=1002.0)
FINISHED = 1002.0
GENERATED = [7, 8, 9]


def serve_args(*argv: str):
    return add_server_args(FlexibleArgumentParser()).parse_args(list(argv))


# ---------------------------------------------------------------------- flags


def test_flags_parse_with_vllms_names():
    args = serve_args()
    assert args.otlp_traces_endpoint is None and args.collect_detailed_traces is None
    check_server_args(args)
    check_server_args(serve_args("--otlp-traces-endpoint", "http://127.0.0.1:4317"))
    with pytest.raises(SystemExit):
        serve_args("--collect-detailed-traces", "gpu")


@pytest.mark.parametrize("value", ["model", "worker", "all", "model,worker"])
def test_detailed_traces_without_an_endpoint_refused(value):
    with pytest.raises(ValueError) as info:
        check_server_args(serve_args("--collect-detailed-traces", value))
    assert str(info.value) == "collect_detailed_traces requires `--otlp-traces-endpoint` to be set."


@pytest.mark.parametrize(
    "values, named",
    [
        (["model"], [A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD]),
        (["worker"], [A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE]),
        (["all"], [A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD, A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE]),
        (["model", "worker"], [A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD, "execute"]),
        (["worker,model"], [A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE, "forward"]),
    ],
)
def test_unmeasured_detailed_traces_refused(values, named):
    argv = ["--otlp-traces-endpoint", "http://127.0.0.1:4317", "--collect-detailed-traces"]
    with pytest.raises(ValueError, match="is not supported yet") as info:
        check_server_args(serve_args(*argv, *values))
    message = str(info.value)
    assert message.startswith(f"--collect-detailed-traces {','.join(values)} is not supported")
    assert all(name in message for name in named) and "is not measured" in message


def test_unknown_protocol_refused():
    args = serve_args("--otlp-traces-endpoint", "http://127.0.0.1:4318")
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'http/json'"):
        check_tracing_args(args, {PROTOCOL_ENV: "http/json"})
    check_tracing_args(args, {PROTOCOL_ENV: "http/protobuf"})
    check_tracing_args(args, {PROTOCOL_ENV: "grpc"})


def test_missing_packages_name_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # ImportError
    args = serve_args("--otlp-traces-endpoint", "http://127.0.0.1:4317")
    with pytest.raises(ValueError) as info:
        check_server_args(args)
    message = str(info.value)
    assert message.startswith("OpenTelemetry is not available.")
    assert "pip install 'jaxengine[otel]'" in message and "opentelemetry-sdk" in message
    check_server_args(serve_args())  # without the flag the packages are not needed


def test_attribute_names_match_the_semantic_conventions():
    """Where the semantic-conventions package names a concept, it spells it as
    vLLM (and we) do."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv

    for name in dir(A):
        if name.startswith("GEN_AI_") and hasattr(semconv, name):
            assert getattr(A, name) == getattr(semconv, name), name


def test_import_leaves_jax_and_otel_out():
    code = (
        "import sys, server.tracing\n"
        "print([m for m in ('jax', 'flax', 'torch', 'opentelemetry.sdk') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- attributes


def _metrics(n: int) -> RequestMetrics:
    """A finished request's timings, with `GENERATED` made for each of ``n`` sequences."""
    metrics = RequestMetrics(arrival_time=ARRIVAL, **TIMES)
    metrics.time_in_queue = TIMES["first_scheduled_time"] - ARRIVAL
    metrics.finished_time = FINISHED
    metrics.num_generation_tokens = n * len(GENERATED)
    return metrics


def _output(request_id: str, prompt: list[int], n: int, metrics: RequestMetrics | None):
    outs = [CompletionOutput(i, "", list(GENERATED), None, None, "length") for i in range(n)]
    return RequestOutput(request_id, None, prompt, None, outs, True, metrics=metrics)


def test_span_attributes_from_timings_and_params():
    params = SamplingParams(n=2, temperature=0.5, top_p=0.75, max_tokens=3)
    attributes = span_attributes(_output("r-0", [1, 2, 3, 4], 2, _metrics(2)), params, "m")
    assert attributes == {
        "gen_ai.response.model": "m",
        "gen_ai.request.id": "r-0",
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.75,
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.n": 2,
        "gen_ai.usage.prompt_tokens": 4,
        "gen_ai.usage.completion_tokens": 6,
        "gen_ai.latency.time_in_queue": 0.25,
        "gen_ai.latency.time_to_first_token": 0.5,
        "gen_ai.latency.e2e": 2.0,
        "gen_ai.latency.time_in_model_prefill": 0.25,
        "gen_ai.latency.time_in_model_decode": 1.5,
        "gen_ai.latency.time_in_model_inference": 1.75,
    }


def test_span_attributes_without_sampling_or_timings():
    """A pooling request has no sampling parameters; an output without engine
    timings gets neither latencies nor a made-up token count."""
    bare = RequestMetrics(arrival_time=ARRIVAL)  # queued, never scheduled
    bare.finished_time = ARRIVAL + 1.0
    attributes = span_attributes(_output("p", [1, 2], 1, bare), PoolingParams(), "m")
    assert attributes == {
        "gen_ai.response.model": "m",
        "gen_ai.request.id": "p",
        "gen_ai.usage.prompt_tokens": 2,
        "gen_ai.usage.completion_tokens": 0,
        "gen_ai.latency.e2e": 1.0,
    }
    attributes = span_attributes(_output("q", [1], 1, None), SamplingParams(), "m")
    assert "gen_ai.usage.completion_tokens" not in attributes
    assert not any(k.startswith("gen_ai.latency.") for k in attributes)


# ---------------------------------------------------------------------- spans from the app


class FakeEngine:
    """Just enough of an `EngineClient` for /v1/completions with token-id prompts:
    each request generates `GENERATED` per sequence with fixed `RequestMetrics`."""

    max_model_len, vocab_size, tokenizer, pooler = 512, 100, None, None
    generation_config, is_sleeping = None, False

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            model_config=SimpleNamespace(model="/models/base", served_model_names=["base"]),
            structured_outputs_config=SimpleNamespace(
                reasoning_parser_name=None, reasoning_parser_plugin=None
            ),
            lora_config=SimpleNamespace(enable_lora=False),
            multimodal_config=MultiModalConfig(),
        )

    def prepare(self, prompt, params, lora_request=None) -> PreparedPrompt:
        return PreparedPrompt(None, list(prompt["prompt_token_ids"]), params, lora_request)

    def check_admission(self, seqs: int = 1) -> None:
        """No admission caps here."""

    async def generate(self, prompt: PreparedPrompt, params, request_id, *, priority=0):
        n, ids = params.n, prompt.token_ids
        if params.output_kind is RequestOutputKind.DELTA:
            first = [CompletionOutput(i, "", GENERATED[:1], None, None) for i in range(n)]
            yield RequestOutput(request_id, None, ids, None, first, False, metrics=_metrics(n))
            rest = [CompletionOutput(i, "", GENERATED[1:], None, None, "length") for i in range(n)]
            yield RequestOutput(request_id, None, ids, None, rest, True, metrics=_metrics(n))
            return
        yield _output(request_id, ids, n, _metrics(n))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_the_collector(monkeypatch, protocol):
    monkeypatch.setenv(PROTOCOL_ENV, protocol)
    with OtlpCollector(protocol) as collector:
        app = build(collector.endpoint)
        body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "n": 2, "temperature": 0.5}
        with TestClient(app) as client:
            reply = client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            assert app.state.ctx.tracer.force_flush()
            spans = sorted(collector.spans, key=lambda s: s.attributes[A.GEN_AI_REQUEST_ID])
    request_id = reply.json()["id"]
    assert [s.attributes[A.GEN_AI_REQUEST_ID] for s in spans] == [
        f"{request_id}-0",
        f"{request_id}-1",
    ]
    for span, prompt in zip(spans, body["prompt"], strict=True):
        assert (span.name, span.kind, span.scope) == ("llm_request", "SERVER", "jaxengine.server")
        assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
        assert span.start_time_unix_nano == int(ARRIVAL * 1e9)
        assert span.end_time_unix_nano == int(FINISHED * 1e9)
        attributes = span.attributes
        assert attributes[A.GEN_AI_RESPONSE_MODEL] == "base"
        assert attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] == len(prompt)
        assert attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 2 * len(GENERATED)
        assert attributes[A.GEN_AI_REQUEST_N] == 2 and attributes[A.GEN_AI_REQUEST_MAX_TOKENS] == 3
        assert attributes[A.GEN_AI_REQUEST_TEMPERATURE] == 0.5
        assert attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == 0.5
        assert attributes[A.GEN_AI_LATENCY_E2E] == 2.0
    assert usage["prompt_tokens"] == sum(s.attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] for s in spans)
    assert usage["completion_tokens"] == sum(
        s.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] for s in spans
    )


def test_streamed_request_spanned_once_and_without_a_parent_a_root(monkeypatch):
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    with OtlpCollector("http/protobuf") as collector:
        app = build(collector.endpoint)
        with TestClient(app) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                events = [line for line in reply.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            reply = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3})
            assert reply.status_code == 200
            assert app.state.ctx.tracer.force_flush()
            spans = list(collector.spans)
    assert len(spans) == 2
    streamed = next(s for s in spans if s.attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] == 3)
    assert streamed.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == len(GENERATED)
    for span in spans:  # no traceparent: each is the root of a trace of its own
        assert span.parent_span_id == "" and len(span.trace_id) == 32
    assert spans[0].trace_id != spans[1].trace_id


def test_no_tracer_without_the_flag():
    from server.api_server.app import build_app

    app = build_app(FakeEngine(), serve_args())
    assert app.state.ctx.tracer is None


def build(endpoint: str):
    from server.api_server.app import build_app

    return build_app(FakeEngine(), serve_args("--otlp-traces-endpoint", endpoint))
