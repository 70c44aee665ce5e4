"""Anthropic's Messages API over chat completions: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A request is translated to the equivalent `ChatCompletionRequest`
(`server/messages/translate.py`) and queued by `ChatHandler.start`, so the prompt,
sampling, tools, reasoning, LoRA adapters (named in ``model``), the request log and
the engine's metrics are chat's; the chat.completion (or its chunks) is reshaped into
Anthropic's message (`server/messages/response.py`) or events
(`server/messages/stream.py`). count_tokens renders the same prompt chat would. Both
routes answer errors in Anthropic's shape (`server/messages/errors.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from server.chat.serving import ChatHandler
from server.messages.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from server.messages.response import from_chat_completion, message_id
from server.messages.stream import anthropic_sse, message_events
from server.messages.translate import to_chat_request
from server.serving import ServingContext, until_disconnected


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
