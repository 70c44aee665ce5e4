"""`server.disconnect` and `serving.until_disconnected`: a client's disconnect cancels
its work and ends its request quietly; any other cancellation (the server shutting
down) goes on."""

from __future__ import annotations

import asyncio

import pytest

from server.disconnect import ClientDisconnected, DisconnectMiddleware
from server.serving import until_disconnected

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


class _Client:
    """A request whose client disconnects when ``gone`` is set."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_until_disconnected_cancels_the_work_and_names_a_disconnect_only():
    async def run(disconnect: bool) -> tuple[BaseException | None, bool]:
        client, work = _Client(), asyncio.ensure_future(asyncio.sleep(60))

        async def handle() -> BaseException | None:  # in one task, as the ASGI app's
            try:
                await until_disconnected(client, work)
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                return e
            return None

        handler = asyncio.ensure_future(handle())
        await asyncio.sleep(0.01)
        if disconnect:
            client.gone.set()
        else:
            handler.cancel()  # the server stopping
        return await handler, work.cancelled()

    error, cancelled = asyncio.run(run(disconnect=True))
    assert isinstance(error, ClientDisconnected) and cancelled
    error, cancelled = asyncio.run(run(disconnect=False))
    assert type(error) is asyncio.CancelledError and cancelled
