"""The drain's parts without a model (server/api_server/drain.py): what a draining app answers
(503, ``Retry-After``, OpenAI's or Anthropic's error JSON, ``/health`` too), the
``--shutdown-timeout`` flag, and `Drain.run`'s order (wait for the requests in
flight, abort only what outlasts the timeout, then stop uvicorn; a second signal
forces the exit), and the 503 of a request that a draining headless node refused.
tests/server/test_graceful_drain.py drives real servers."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.entrypoints.client import EngineDrainingError
from server.api_server.app import build_app
from server.api_server.args import add_server_args
from server.api_server.drain import Drain
from tests.unit.test_server_request_logs import FakeEngine as FakeAppEngine
from tests.unit.test_server_request_logs import client, completion


def test_flag_defaults_to_vllms_zero_and_refuses_negative_seconds() -> None:
    parser = add_server_args(FlexibleArgumentParser())
    assert parser.parse_args([]).shutdown_timeout == 0.0
    assert parser.parse_args(["--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--shutdown-timeout", "-1"])


def test_a_draining_app_refuses_new_requests_and_health() -> None:
    http = client("--shutdown-timeout", "30")
    assert completion(http).status_code == 200  # (the fake engine has no /health)
    http.app.state.drain.deadline = time.monotonic() + 30  # as the signal sets it

    for response in (completion(http), http.get("/health")):
        assert response.status_code == 503
        assert 1 <= int(response.headers["retry-after"]) <= 30
        error = response.json()["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    messages = http.post("/v1/messages", json=body)
    assert messages.status_code == 503  # in Anthropic's shape on its route
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "overloaded_error"


class DrainingNodeEngine(FakeAppEngine):
    """An engine whose replica is a headless node that is draining."""

    async def generate(self, prepared, params, request_id, priority=0):
        raise EngineDrainingError("data parallel rank 1 is shutting down")
        yield  # an async generator, as the real one


def test_a_draining_nodes_refusal_is_a_503() -> None:
    args = add_server_args(FlexibleArgumentParser()).parse_args([])
    response = completion(TestClient(build_app(DrainingNodeEngine(), args)))
    assert response.status_code == 503, response.text
    assert "rank 1 is shutting down" in response.json()["error"]["message"]


class FakeEngine:
    """Counts `abort_all` calls; an abort ends the requests in flight (``drain``'s)."""

    def __init__(self) -> None:
        self.aborts: list[float] = []
        self.drain: Drain | None = None

    async def abort_all(self) -> None:
        self.aborts.append(time.monotonic())
        while self.drain.in_flight.count:
            self.drain.in_flight.leave()


async def _drain_with(timeout: float, finish_after: float | None) -> tuple[Drain, FakeEngine]:
    """Two requests in flight at the signal, ending by themselves ``finish_after``
    seconds later (None: never); the drain runs to its end."""
    engine = FakeEngine()
    drain = engine.drain = Drain(engine, timeout)
    drain.server = SimpleNamespace(should_exit=False, force_exit=False)
    drain.in_flight.enter(), drain.in_flight.enter()
    drain.on_signal(signal.SIGTERM)
    if finish_after is not None:
        await asyncio.sleep(finish_after)
        drain.in_flight.leave(), drain.in_flight.leave()
    await drain._task
    return drain, engine


def test_requests_that_finish_in_time_are_not_aborted() -> None:
    started = time.monotonic()
    drain, engine = asyncio.run(_drain_with(timeout=5.0, finish_after=0.3))
    assert engine.aborts == []
    assert drain.server.should_exit and not drain.server.force_exit
    assert time.monotonic() - started < 2.0  # stops once idle, not at the timeout


def test_what_outlasts_the_timeout_is_aborted_then_the_server_stops() -> None:
    started = time.monotonic()
    drain, engine = asyncio.run(_drain_with(timeout=0.3, finish_after=None))
    assert len(engine.aborts) == 1 and engine.aborts[0] - started >= 0.3
    assert drain.in_flight.count == 0 and drain.server.should_exit


def test_a_zero_timeout_aborts_at_once_and_a_second_signal_forces_the_exit() -> None:
    async def run() -> tuple[Drain, FakeEngine]:
        engine = FakeEngine()
        drain = engine.drain = Drain(engine, 0.0)
        drain.server = SimpleNamespace(should_exit=False, force_exit=False)
        drain.in_flight.enter()
        drain.on_signal(signal.SIGTERM)
        assert drain.draining and not drain.server.force_exit
        drain.on_signal(signal.SIGINT)
        assert drain.server.force_exit and drain.server.should_exit
        await drain._task
        return drain, engine

    drain, engine = asyncio.run(run())
    assert len(engine.aborts) == 1 and drain.in_flight.count == 0
