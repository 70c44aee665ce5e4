"""``--h11-max-header-count``: a limit on the number of headers in a request.

vLLM hands the count to its HTTP server; h11, the parser uvicorn runs here, has no
such setting (only the size of a request head, ``--h11-max-incomplete-event-size``,
which `server/api_server/launch.py` passes to uvicorn). So the count is checked first thing in
the app, on the parsed headers: a request with more gets 431 Request Header Fields Too
Large, in OpenAI's error shape, before any route, middleware or authentication runs.
"""

from __future__ import annotations

from server.errors import error_response


class HeaderCountLimitMiddleware:
    """431 for an HTTP request carrying more than ``max_count`` headers (a
    WebSocket's handshake is closed instead)."""

    def __init__(self, app, max_count: int) -> None:
        self.app = app
        self.max_count = max_count

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        count = len(scope["headers"])
        if count <= self.max_count:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        message = (
            f"Request Header Fields Too Large: {count} headers, more than "
            f"--h11-max-header-count {self.max_count}"
        )
        return await error_response(message, 431)(scope, receive, send)
