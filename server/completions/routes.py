"""The completions route: ``POST /v1/completions`` (`server/completions/serving.py`
answers it)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request

from server.completions.protocol import CompletionRequest
from server.completions.serving import CompletionHandler
from server.respond import respond
from server.serving import ServingContext


def add_completions_routes(
    app: FastAPI, ctx: ServingContext, check_awake: Callable[[ServingContext], None]
) -> CompletionHandler:
    """``POST /v1/completions`` on ``app``; ``check_awake``: the app's 503 while the
    engine sleeps."""
    completions = CompletionHandler(ctx)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        check_awake(ctx)
        return respond(await completions.create(request, raw_request), raw_request)

    return completions
