"""Anthropic's Messages routes: ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` (`server/messages/serving.py` runs them), registered with
`AnthropicRoute` so that their errors answer in Anthropic's shape.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request

from server.chat.serving import ChatHandler
from server.messages.errors import AnthropicRoute
from server.messages.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from server.messages.serving import MessagesHandler
from server.respond import respond
from server.serving import ServingContext


def add_messages_routes(
    app: FastAPI,
    ctx: ServingContext,
    chat: ChatHandler,
    check_awake: Callable[[ServingContext], None],
) -> None:
    """Registers both routes; ``check_awake`` raises while the engine sleeps."""
    handler = MessagesHandler(ctx, chat)
    router = APIRouter(route_class=AnthropicRoute)

    @router.post("/v1/messages")
    async def create_message(request: AnthropicMessagesRequest, raw_request: Request):
        check_awake(ctx)
        return respond(await handler.create(request, raw_request), raw_request)

    @router.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: AnthropicCountTokensRequest):
        return handler.count_tokens(request)

    app.include_router(router)
