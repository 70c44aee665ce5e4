"""OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise `APIError` (or let a `ValueError` from validation escape); the app's
exception handlers turn both, and FastAPI's request validation errors, into this
body with the right status. Nothing is queued for a request that fails here. With
``--log-error-stack`` (`log_error_stacks`), each of those answers also logs the stack
trace of the exception behind it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from fastapi.responses import JSONResponse

logger = logging.getLogger("jaxengine.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with an HTTP status, reported in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of pydantic/FastAPI validation errors, as vLLM words them.

    The message is vLLM's: ``"N validation error(s):"`` then each error as pydantic
    reports it (its ``type``, ``loc``, ``msg``, ``input`` and ``ctx``), one per line,
    so a client sees the error type (e.g. ``greater_than_equal``) and the limit. The
    param is the first error's top-level field.
    """
    param = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if loc and not loc[0].isdigit():  # a digit: a position in the JSON text
            param = loc[0]
            break
    if not errors:
        return "Validation error", None
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"\n  {_public(err)}" for err in errors)
    return f"{len(errors)} validation {label}:{lines}", param


def _public(err: dict[str, Any]) -> dict[str, Any]:
    """The error without the documentation URL pydantic may add."""
    return {k: v for k, v in err.items() if k != "url"}


def log_error_stacks(app: Any) -> None:
    """``--log-error-stack``: every exception handler of ``app`` (but the one for any
    `Exception`, which logs its stack already) also logs the stack trace of the error
    it answers with. Called after the handlers are registered, before serving."""
    handlers = app.exception_handlers
    for key, handler in list(handlers.items()):
        if key is not Exception:
            handlers[key] = _logging_stack(handler)


def _logging_stack(handler: Any) -> Any:
    async def handle(request: Any, exc: Exception) -> Any:
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        log_error_stack(exc, response.status_code, f"{request.method} {request.url.path}")
        return response

    return handle


def log_error_stack(exc: BaseException, status: int, where: str) -> None:
    """Logs ``exc`` with its stack trace as the cause of a ``status`` error answer."""
    logger.error("error response %d to %s: %s", status, where, exc, exc_info=exc)
