"""`server.disconnect`: a client's disconnect ends its request quietly; any other
cancellation (the server shutting down) goes on."""

from __future__ import annotations

import asyncio

import pytest

from server.disconnect import ClientDisconnected, DisconnectMiddleware

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions"}


def test_a_disconnect_ends_quietly_and_other_cancellations_go_on():
    async def gone(scope, receive, send):
        raise ClientDisconnected("client disconnected")

    async def shutdown(scope, receive, send):
        raise asyncio.CancelledError

    assert issubclass(ClientDisconnected, asyncio.CancelledError)  # handlers' cleanup runs
    assert asyncio.run(DisconnectMiddleware(gone)(SCOPE, None, None)) is None
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(DisconnectMiddleware(shutdown)(SCOPE, None, None))
