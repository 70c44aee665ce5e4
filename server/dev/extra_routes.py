"""vLLM's routes beyond OpenAI's.

- ``GET /tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``): the tokenizer's
  configuration, as its ``tokenizer_config.json`` would give it.
- SageMaker's ``POST /invocations``, which serves a body with the endpoint whose
  request it validates as (chat completions, then completions; on a pooling model
  embeddings and pooling, or classification, rerank and score), and ``/ping``.

``POST /v1/chat/completions/batch`` is `server/batch/routes.py`'s; the ORCA load
header that JSON answers carry is `server/respond.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from jaxengine.entrypoints.client import EngineDeadError
from jaxengine.tokenizer import resolve_chat_template
from server.chat.protocol import ChatCompletionRequest
from server.completions.protocol import CompletionRequest
from server.errors import APIError, error_response
from server.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from server.respond import respond
from server.serving import ServingContext

# ---------------------------------------------------------------------- routes


def add_extra_routes(
    app: FastAPI, ctx: ServingContext, handlers: dict[str, Any], args: Any
) -> None:
    """The routes above. ``handlers``: "chat", "completions", "embeddings", "scores"."""
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
