"""The Responses API's routes: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` (`server/responses/serving.py`
runs them).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.chat.serving import ChatHandler
from server.errors import APIError
from server.responses.protocol import ResponsesRequest
from server.responses.serving import ResponsesHandler
from server.responses.store import ResponseStore
from server.serving import ServingContext


def add_responses_routes(
    app: FastAPI,
    ctx: ServingContext,
    chat: ChatHandler,
    max_stored: int,
    check_awake: Callable[[ServingContext], None],
) -> ResponsesHandler:
    """The Responses routes on ``app``; ``max_stored``: --max-stored-responses;
    ``check_awake``: the app's 503 while the engine sleeps, run before a response
    starts."""
    handler = ResponsesHandler(ctx, chat, ResponseStore(max_stored))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        check_awake(ctx)
        result = await handler.create(request, raw_request)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:
            raise APIError("streaming a stored response back is not supported", param="stream")
        return handler.record(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return handler.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await handler.cancel(response_id)

    return handler
