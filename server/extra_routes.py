"""vLLM's routes beyond OpenAI's, and its ORCA load header.

- ``GET /tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``): the tokenizer's
  configuration, as its ``tokenizer_config.json`` would give it.
- ``POST /v1/chat/completions/batch``: several conversations in one request
  (`server/serving_chat_batch.py`).
- SageMaker's ``POST /invocations``, which serves a body with the endpoint whose
  request it validates as (chat completions, then completions; on a pooling model
  embeddings and pooling, or classification, rerank and score), and ``/ping``.
- ORCA: a JSON chat or completion response to a request with the
  ``endpoint-load-metrics-format`` header (``TEXT`` or ``JSON``) carries an
  ``endpoint-load-metrics`` header with the engine's load (`orca_header`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from jaxengine.entrypoints.client import EngineDeadError
from jaxengine.tokenizer import resolve_chat_template
from server.errors import APIError, error_response
from server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from server.serving import ServingContext
from server.serving_chat_batch import BatchChatCompletionRequest, BatchChatHandler

logger = logging.getLogger("jaxengine.server")

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"
ORCA_METRICS = {  # Prometheus gauge -> ORCA named metric (vLLM's pair)
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:num_requests_waiting": "num_requests_waiting",
}


# ---------------------------------------------------------------------- ORCA


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


# ---------------------------------------------------------------------- routes


def add_extra_routes(
    app: FastAPI, ctx: ServingContext, handlers: dict[str, Any], args: Any
) -> None:
    """The routes above. ``handlers``: "chat", "completions", "embeddings", "scores"."""
    batch = BatchChatHandler(handlers["chat"])

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(
        request: BatchChatCompletionRequest, raw_request: Request
    ):
        return respond(await batch.create(request, raw_request))

    if getattr(args, "enable_tokenizer_info_endpoint", False):

        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return tokenizer_info(ctx.need_tokenizer(), ctx.options.chat_template)

    _add_sagemaker_routes(app, ctx, handlers)


def _add_sagemaker_routes(app: FastAPI, ctx: ServingContext, handlers: dict[str, Any]) -> None:
    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        """SageMaker's health check: /health's answer."""
        try:
            await ctx.engine.check_health()
        except EngineDeadError as e:
            return error_response(str(e), 503)
        return Response(status_code=200)

    @app.post("/invocations")
    async def invocations(raw_request: Request):
        try:
            body = await raw_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"JSON decode error: {e}") from None
        types = invocation_types(ctx, handlers)
        for model_cls, endpoint in types:
            try:
                request = model_cls.model_validate(body)
            except ValidationError:
                continue
            return respond(await endpoint(request, raw_request), raw_request)
        names = [model_cls.__name__ for model_cls, _ in types]
        raise APIError(f"Cannot find suitable handler for request. Expected one of: {names}")


def invocation_types(ctx: ServingContext, handlers: dict[str, Any]) -> list[tuple[type, Callable]]:
    """(request model, handler method) pairs that /invocations tries, in vLLM's order:
    a generating model's chat completions then completions; an embedding model's
    embeddings then pooling; a classification model's classify, rerank and score."""
    pooler = ctx.engine.pooler
    if pooler is None:
        return [
            (ChatCompletionRequest, handlers["chat"].create),
            (CompletionRequest, handlers["completions"].create),
        ]
    if pooler.num_labels:
        scores = handlers["scores"]
        return [
            (ClassificationRequest, scores.classify),
            (RerankRequest, scores.rerank),
            (ScoreRequest, scores.score),
        ]
    embeddings = handlers["embeddings"]
    return [(EmbeddingRequest, embeddings.create), (PoolingRequest, embeddings.pooling)]


# ---------------------------------------------------------------------- tokenizer info


def tokenizer_info(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init arguments (its tokenizer_config.json)
    without file paths, special tokens as their text, ``tokenizer_class``, and the
    server's ``--chat-template`` when one is given."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = resolve_chat_template(tokenizer, chat_template)
    return config


def _jsonable(value: Any) -> Any:
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
