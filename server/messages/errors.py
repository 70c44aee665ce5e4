"""Anthropic's error JSON for the Messages routes: ``{"type": "error", "error": {"type",
"message"}}``, with the HTTP status that Anthropic gives each error type.

The app's own exception handlers answer in OpenAI's shape (`server/errors.py`); the
Messages routes are registered with `AnthropicRoute`, whose handler turns the same
exceptions (request validation included) into this shape before they reach the
app's handlers. `AuthMiddleware` (server/api_server/app.py) asks `is_messages_path` to answer a
missing key in the same shape. A stream that fails after its status line carries
the error as an ``event: error`` (`server/messages/stream.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.engine.rollout import EngineSleepingError
from jaxengine.entrypoints.client import EngineDeadError
from server.errors import APIError, validation_message

logger = logging.getLogger("jaxengine.server")

MESSAGES_PATH = "/v1/messages"
"""The Messages API's routes: this path and those under it (``/count_tokens``)."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # the sleeping engine; Anthropic's own overload is a 529
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (a 4xx not listed is a request error)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status), status_code=status)


def error_status(exc: Exception) -> tuple[str, int]:
    """(message, HTTP status) of an exception, as the app's handlers rate them."""
    if isinstance(exc, APIError):
        return exc.message, exc.status
    if isinstance(exc, RequestValidationError):
        return validation_message(list(exc.errors()))[0], 400
    if isinstance(exc, EngineDeadError):
        return str(exc), 500
    if isinstance(exc, EngineSleepingError):
        return str(exc), 503
    if isinstance(exc, StarletteHTTPException):
        return str(exc.detail), exc.status_code
    if isinstance(exc, ValueError):
        return str(exc), 400
    logger.exception("request failed", exc_info=exc)
    return f"internal error: {exc!r}", 500


class AnthropicRoute(APIRoute):
    """A route whose errors (request validation, the handler's exceptions) answer in
    Anthropic's shape. A client disconnect (`asyncio.CancelledError`) goes through."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every error is reported to the client
                message, status = error_status(exc)
                return anthropic_error_response(message, status)

        return guarded
