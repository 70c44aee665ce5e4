"""Clients that give up: their requests are aborted and their pages freed at once.

100 requests whose clients time out after half a second, and streams closed after
their first chunk, leave the server answering a new request within 5 seconds, with
no request running or waiting and no KV page held (read from `/metrics`), and no
error logged for them.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.server.conftest import MODEL


def _settled(server, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (the gauges refresh every engine loop)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m["jaxengine:num_requests_running"] == 0
            and m["jaxengine:num_requests_waiting"] == 0
            and m["jaxengine:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


async def _time_out_many(server, count: int) -> int:
    client = server.async_client(max_retries=0, timeout=0.5)

    async def one(i: int) -> bool:
        try:
            await client.completions.create(
                model=MODEL,
                prompt=f"Write a very long story about the number {i}.",
                max_tokens=256,
                extra_body={"ignore_eos": True},
            )
        except openai.APITimeoutError:
            return True
        return False

    try:
        return sum(await asyncio.gather(*(one(i) for i in range(count))))
    finally:
        await client.close()


async def _close_streams_early(server, count: int) -> int:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 256, "stream": True}
    body["ignore_eos"] = True
    closed = 0
    async with httpx.AsyncClient(headers=server.headers, timeout=60) as http:
        for _ in range(count):
            async with http.stream("POST", server.base_url + "/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        closed += 1
                        break  # leaving the block closes the connection
    return closed


def _asgi_errors(server) -> int:
    return server.log_path.read_text(errors="replace").count("Exception in ASGI application")


def test_timed_out_clients_are_aborted(server):
    errors = _asgi_errors(server)
    timed_out = asyncio.run(_time_out_many(server, 100))
    assert timed_out == 100  # 256 tokens each cannot finish in half a second
    quick = server.client(max_retries=0, timeout=5.0)
    reply = quick.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert reply.choices[0].text
    m = _settled(server)
    assert m["jaxengine:num_requests_running"] == 0
    assert m["jaxengine:num_requests_waiting"] == 0
    assert m["jaxengine:kv_cache_usage_perc"] == 0  # no page is leaked
    assert server.get("/load").json() == {"server_load": 0}
    assert _asgi_errors(server) == errors  # a client gone is no application error


def test_closed_streams_are_aborted(server):
    before = server.metrics().get("jaxengine:request_success_total", 0.0)
    assert asyncio.run(_close_streams_early(server, 8)) == 8
    m = _settled(server)
    assert m["jaxengine:num_requests_running"] == 0
    assert m["jaxengine:kv_cache_usage_perc"] == 0
    aborted = [v for k, v in m.items() if 'finished_reason="abort"' in k and "success" in k]
    assert aborted and aborted[0] >= 8
    assert m["jaxengine:request_success_total"] - before >= 8
