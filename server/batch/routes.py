"""``POST /v1/chat/completions/batch``: several conversations in one request
(`server/batch/chat.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from server.batch.chat import BatchChatCompletionRequest, BatchChatHandler
from server.respond import respond


def add_batch_routes(app: FastAPI, chat: Any) -> None:
    """The route above, over ``chat`` (the app's `ChatHandler`)."""
    batch = BatchChatHandler(chat)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(
        request: BatchChatCompletionRequest, raw_request: Request
    ):
        return respond(await batch.create(request, raw_request))
