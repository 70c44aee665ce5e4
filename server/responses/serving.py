"""OpenAI's Responses API over chat completions: ``POST /v1/responses``, ``GET`` /
``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A request is translated into a `ChatCompletionRequest` (`server/responses/input.py`)
and run by `ChatHandler.start`, so the prompt, sampling, tool choice, structured
outputs, the reasoning and tool parsers, LoRA adapters named in ``model``, the
request log and the metrics are chat's. Its chat result is reshaped into a Response
object (`server/responses/output.py`), or its chunk stream into Responses events
(`server/responses/stream.py`).

``store`` (default true) keeps the response in memory (`server/responses/store.py`,
``--max-stored-responses``) for ``GET``, ``cancel`` and ``previous_response_id``.
``background: true`` answers at once with status ``"queued"`` and runs the response
as an asyncio task; ``cancel`` stops it (its engine request is aborted). Streaming a
background response, and streaming a stored one back from ``GET``, are refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from server.chat.serving import ChatHandler
from server.errors import ERROR_TYPES, APIError
from server.responses.input import CHAT_PARAMS, chat_request, input_messages
from server.responses.output import base_response, new_id
from server.responses.protocol import ResponsesRequest
from server.responses.run import ResponseRun
from server.responses.store import ResponseStore, StoredResponse
from server.responses.stream import sse_event
from server.serving import ServingContext, until_disconnected

logger = logging.getLogger("jaxengine.server")

CONTINUABLE = ("completed", "incomplete")
"""The statuses of a response that ``previous_response_id`` may continue."""


class ResponsesHandler:
    """Runs Responses requests through ``chat`` and keeps them in ``store``."""

    def __init__(self, ctx: ServingContext, chat: ChatHandler, store: ResponseStore) -> None:
        self.ctx = ctx
        self.chat = chat
        self.store = store

    async def start(self, request: ResponsesRequest) -> ResponseRun:
        """Validates and queues the request (every 400 and 404 comes from here)."""
        if request.background and request.stream:
            raise APIError("streaming a background response is not supported", param="stream")
        if request.background and self.store.capacity == 0:
            raise APIError(
                "background responses need the response store (--max-stored-responses > 0)",
                param="background",
            )
        response_id = request.request_id or new_id("resp")
        if response_id in self.store:
            raise APIError(f"a response with id {response_id!r} exists", param="request_id")
        model = self.ctx.check_model(request.model)
        conversation = self._history(request.previous_response_id)
        conversation += input_messages(request.input)
        chat = chat_request(request, conversation, response_id)
        try:
            view, streams = await self.chat.start(chat)
        except APIError as e:
            raise APIError(e.message, e.status, CHAT_PARAMS.get(e.param, e.param)) from None
        base = base_response(request, response_id, model, self.ctx.default_sampling)
        fmt = getattr(self.chat, "chat_format", None)  # harmony counts its own reasoning
        parser = fmt.reasoning_counter() if fmt is not None else self.ctx.reasoning_parser()
        return ResponseRun(view, streams, base, conversation, parser, request.stream)

    def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        record = self.record(previous_id)
        if record.status not in CONTINUABLE:
            raise APIError(
                f"previous response {previous_id!r} is {record.status}: only a completed or "
                "incomplete response can be continued",
                param="previous_response_id",
            )
        return list(record.conversation)

    def record(self, response_id: str) -> StoredResponse:
        """The stored response; 404 in OpenAI's shape for an unknown id."""
        record = self.store.get(response_id)
        if record is None:
            raise APIError(f"Response with id {response_id!r} not found.", 404)
        return record

    async def create(self, request: ResponsesRequest, raw_request: Request | None = None):
        """A Response object (dict), or an SSE stream of events (an async iterator)."""
        run = await self.start(request)
        record = StoredResponse(run.base)
        if request.store:
            self.store.put(record)
        if request.background:
            record.response = {**run.base, "status": "queued"}
            record.task = asyncio.create_task(self._background(run, record))
            return record.response
        if request.stream:
            return self._sse(run, record)
        try:
            response = await until_disconnected(raw_request, run.collect())
        except BaseException as e:
            _fail(record, e)
            raise
        self._finish(run, record, response)
        return response

    def _finish(self, run: ResponseRun, record: StoredResponse, response: dict) -> None:
        record.response = response
        record.conversation = run.conversation_after(response)

    async def _background(self, run: ResponseRun, record: StoredResponse) -> None:
        record.response = {**record.response, "status": "in_progress"}
        try:
            response = await run.collect()
        except BaseException as e:
            _fail(record, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            logger.exception("background response %s failed", run.id)
            return
        self._finish(run, record, response)

    async def _sse(self, run: ResponseRun, record: StoredResponse):
        """The events as SSE; a failure ends the stream with ``error`` and
        ``response.failed`` events (the status line has been sent)."""
        events = run.stream()
        try:
            async for event in events:
                yield sse_event(event)
        except Exception as e:  # noqa: BLE001 - reported in-band, the server goes on
            logger.exception("response stream %s failed", run.id)
            _fail(record, e)
            for event in run.events.failed(_message(e), _code(e), record.response):
                yield sse_event(event)
            return
        except BaseException as e:  # the client went away: the stream is closed
            _fail(record, e)
            raise
        finally:
            await events.aclose()
        if run.final is not None:
            self._finish(run, record, run.final)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancels a background response that is queued or in progress (vLLM's rule)."""
        record = self.record(response_id)
        if record.task is None or record.finished:
            raise APIError(
                f"response {response_id!r} is {record.status}: only a background response "
                "that is queued or in progress can be cancelled"
            )
        record.task.cancel()
        await asyncio.gather(record.task, return_exceptions=True)
        _fail(record, asyncio.CancelledError())  # a task cancelled before it ran
        return record.response

    def delete(self, response_id: str) -> dict[str, Any]:
        record = self.record(response_id)
        self.store.pop(response_id)
        if record.task is not None and not record.task.done():
            record.task.cancel()
            _fail(record, asyncio.CancelledError())
        return {"id": response_id, "object": "response", "deleted": True}


def _fail(record: StoredResponse, error: BaseException) -> None:
    """Marks an unfinished response cancelled (cancellation, a client gone) or failed."""
    if record.finished:
        return
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        record.response = {**record.response, "status": "cancelled"}
        return
    failure = {"code": "server_error", "message": _message(error)}
    record.response = {**record.response, "status": "failed", "error": failure}


def _message(error: BaseException) -> str:
    return error.message if isinstance(error, APIError) else str(error) or repr(error)


def _code(error: BaseException) -> str:
    status = error.status if isinstance(error, APIError) else 500
    return ERROR_TYPES.get(status, "APIError")
