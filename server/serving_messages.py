"""Anthropic's Messages API over chat completions: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A request is translated to the equivalent `ChatCompletionRequest`
(`server/anthropic_translate.py`) and queued by `ChatHandler.start`, so the prompt,
sampling, tools, reasoning, LoRA adapters (named in ``model``), the request log and
the engine's metrics are chat's; the chat.completion (or its chunks) is reshaped into
Anthropic's message (`server/anthropic_response.py`) or events
(`server/anthropic_stream.py`). count_tokens renders the same prompt chat would. Both
routes answer errors in Anthropic's shape (`server/anthropic_errors.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from server.anthropic_errors import AnthropicRoute
from server.anthropic_protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from server.anthropic_response import from_chat_completion, message_id
from server.anthropic_stream import anthropic_sse, message_events
from server.anthropic_translate import to_chat_request
from server.extra_routes import respond
from server.serving import ServingContext, until_disconnected
from server.serving_chat import ChatHandler


class MessagesHandler:
    """Runs Messages requests through a `ChatHandler`."""

    def __init__(self, ctx: ServingContext, chat: ChatHandler) -> None:
        self.ctx = ctx
        self.chat = chat

    @property
    def reasoning(self) -> bool:
        """Whether the server runs a reasoning parser (``thinking`` needs one)."""
        return bool(self.ctx.options.reasoning_parser)

    async def create(
        self, request: AnthropicMessagesRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        """The message (a dict), or its server-sent events when ``stream`` is set."""
        msg_id = message_id()
        chat_request = to_chat_request(request, self.reasoning, msg_id)
        view, streams = await self.chat.start(chat_request)
        shown = request.thinking is None or request.thinking.display != "omitted"
        if request.stream:
            chunks = view.stream(streams)
            return anthropic_sse(message_events(chunks, msg_id, view.model, shown))
        completion = await until_disconnected(raw_request, view.collect(streams))
        return from_chat_completion(completion, shown)

    def count_tokens(self, request: AnthropicCountTokensRequest) -> dict[str, int]:
        """``{"input_tokens": n}``: the prompt chat renders for the same conversation."""
        self.ctx.check_model(request.model)
        chat_request = to_chat_request(request, self.reasoning)
        return {"input_tokens": len(chat_request.kept_prompt(self.chat.render(chat_request)))}


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
