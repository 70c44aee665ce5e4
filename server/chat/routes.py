"""The chat completions route: ``POST /v1/chat/completions`` (`server/chat/serving.py`
answers it)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request

from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.respond import respond
from server.serving import ServingContext


def add_chat_routes(
    app: FastAPI,
    ctx: ServingContext,
    chat: ChatHandler,
    check_awake: Callable[[ServingContext], None],
) -> None:
    """``POST /v1/chat/completions`` on ``app``; ``check_awake``: the app's 503 while
    the engine sleeps."""

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        check_awake(ctx)
        return respond(await chat.create(request, raw_request), raw_request)
