"""A client that goes away before its non-streamed answer: its work is cancelled
(`serving.until_disconnected` aborts the engine requests) and nothing is answered.

`ClientDisconnected` is an `asyncio.CancelledError`, so every handler's cleanup runs
as for any cancellation (a stored response is marked cancelled, ...). It then ends at
`DisconnectMiddleware`, which lets the request end quietly, as vLLM's handlers do
(without it the ASGI server would log each one as an application error with its
traceback). A cancellation that is not a disconnect (the server shutting down) goes on.
The handler runs in the request's own task (the app's middleware is pure ASGI), so
the exception reaches the middleware as raised: a task boundary would turn it into a
plain cancellation.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class ClientDisconnected(asyncio.CancelledError):
    """The client disconnected before its answer was ready."""


class DisconnectMiddleware:
    """Ends a request whose client disconnected without an answer or an error log."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnected:
            logger.debug("client disconnected: %s %s", scope.get("method"), scope.get("path"))
