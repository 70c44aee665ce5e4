"""The OpenAI batch file format, run offline through the server's own handlers.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/completions`` or ``/v1/chat/completions``. Each output line, in input order:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
     "request_id": ..., "body": {...}}, "error": null}

A request the handlers reject (bad parameters, a prompt too long, an unknown model)
gets its HTTP status and OpenAI error body in ``response``, as the server would
answer; a line that is not a request at all (bad JSON, no ``body``, another URL)
gets ``response: null`` and ``error: {"code", "message"}``. No line stops the run.
All requests go to the engine at once, so it batches them.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.completions.protocol import CompletionRequest
from server.completions.serving import CompletionHandler
from server.errors import APIError, error_body, validation_message
from server.serving import ServingContext

ROUTES = {
    "/v1/completions": (CompletionRequest, CompletionHandler),
    "/v1/chat/completions": (ChatCompletionRequest, ChatHandler),
}


class LineError(Exception):
    """A line that is not a runnable batch request."""


def parse_line(line: str) -> tuple[str | None, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; raises LineError."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise LineError(f"invalid JSON: {e}") from None
    if not isinstance(item, dict):
        raise LineError("each line must be a JSON object")
    custom_id = item.get("custom_id")
    method = str(item.get("method", "POST")).upper()
    url = item.get("url")
    body = item.get("body")
    if method != "POST":
        raise LineError(f"method {method!r} is not supported (POST only)")
    if url not in ROUTES:
        raise LineError(f"url {url!r} is not supported; use one of {sorted(ROUTES)}")
    if not isinstance(body, dict):
        raise LineError("the line has no `body` object")
    return custom_id, url, body


async def run_line(ctx: ServingContext, handlers: dict, line: str) -> dict[str, Any]:
    """The output record of one input line (never raises)."""
    custom_id = _custom_id(line)
    try:
        custom_id, url, body = parse_line(line)
    except LineError as e:
        return _record(custom_id, None, {"code": "invalid_request", "message": str(e)})
    model_cls, handler = handlers[url]
    request_id = f"batch-{uuid.uuid4().hex}"
    try:
        request = model_cls.model_validate(body)
        if request.stream:
            raise APIError("stream is not supported in batch requests", param="stream")
        result = await handler.create(request)
        status, payload = 200, result
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        status, payload = 400, error_body(message, 400, param)
    except APIError as e:
        status, payload = e.status, error_body(e.message, e.status, e.param)
    except ValueError as e:
        status, payload = 400, error_body(str(e), 400)
    except Exception as e:  # noqa: BLE001 - reported in the line; the run goes on
        status, payload = 500, error_body(f"internal error: {e!r}", 500)
    response = {"status_code": status, "request_id": request_id, "body": payload}
    return _record(custom_id, response, None)


async def run_batch(ctx: ServingContext, lines: Sequence[str], progress: Any = None) -> list:
    """Output records for ``lines`` (blank lines skipped), in input order."""
    handlers = {url: (m, h(ctx)) for url, (m, h) in ROUTES.items()}

    async def one(line: str) -> dict:
        record = await run_line(ctx, handlers, line)
        if progress is not None:
            progress.update(1)
        return record

    return await asyncio.gather(*(one(line) for line in lines if line.strip()))


def _custom_id(line: str) -> str | None:
    try:
        item = json.loads(line)
    except json.JSONDecodeError:
        return None
    return item.get("custom_id") if isinstance(item, dict) else None


def _record(custom_id, response, error) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
