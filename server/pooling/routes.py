"""A pooling model's routes (``--runner pooling``): /v1/embeddings, /pooling,
Cohere's /v2/embed, and a classification model's /score, /rerank (with /v1/ aliases)
and /classify."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from server.pooling.cohere import CohereEmbedHandler, CohereEmbedRequest
from server.pooling.embedding import EmbeddingHandler
from server.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from server.pooling.score import ScoreHandler
from server.respond import respond
from server.serving import ServingContext


def add_pooling_routes(app: FastAPI, ctx: ServingContext, chat: Any) -> None:
    """The routes above; ``chat``: the `ChatHandler` that renders an embedding
    request's ``messages``."""
    embeddings = EmbeddingHandler(ctx, chat)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request):
        return respond(await embeddings.create(request, raw_request))

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request):
        return respond(await embeddings.pooling(request, raw_request))

    cohere = CohereEmbedHandler(ctx)

    @app.post("/v2/embed")  # Cohere's
    async def create_cohere_embedding(request: CohereEmbedRequest, raw_request: Request):
        return respond(await cohere.create(request, raw_request))

    scores = ScoreHandler(ctx)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request):
        return respond(await scores.score(request, raw_request))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(request: RerankRequest, raw_request: Request):
        return respond(await scores.rerank(request, raw_request))

    @app.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request):
        return respond(await scores.classify(request, raw_request))
