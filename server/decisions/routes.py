"""The Decisions API's route: ``POST /v1/decisions`` (`server/decisions/serving.py`
answers it).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request

from server.chat.serving import ChatHandler
from server.decisions.protocol import DecisionRequest
from server.decisions.serving import DecisionsHandler
from server.serving import ServingContext


def add_decisions_routes(
    app: FastAPI,
    ctx: ServingContext,
    chat: ChatHandler,
    check_awake: Callable[[ServingContext], None],
) -> DecisionsHandler:
    """``POST /v1/decisions`` on ``app``; ``check_awake``: the app's 503 while the
    engine sleeps."""
    handler = DecisionsHandler(ctx, chat)

    @app.post("/v1/decisions")
    async def create_decision(request: DecisionRequest, raw_request: Request):
        check_awake(ctx)
        return await handler.create(request, raw_request)

    return handler
