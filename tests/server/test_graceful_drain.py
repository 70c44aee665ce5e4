"""SIGTERM drains `jaxengine serve` (server/api_server/drain.py), with one engine and with two
data-parallel replicas.

Each test starts its own server (the tiny random Llama of `tiny_smollm2`), puts 8
chat streams and 8 non-streamed completions in flight (the official `openai` client,
``ignore_eos`` so each runs its full ``max_tokens``), waits until the engine runs all
16, and sends SIGTERM:

- with a ``--shutdown-timeout`` longer than the work, every request ends after the
  signal with its full output (finish reason ``length``, ``max_tokens`` tokens) before
  the timeout; a request and ``/health`` sent after the signal get 503 with
  ``Retry-After`` and OpenAI's error JSON; the process exits 0;
- with a timeout far shorter than the work, every stream still ends cleanly with a
  last chunk whose finish reason is ``abort`` and ``data: [DONE]``, every non-streamed
  request gets 200 with its partial output (fewer tokens, finish reason ``abort``),
  and the process exits 0 soon after the timeout.

The last two tests run a head and a ``--headless`` node (rank 1; marked slow, as
tests/server/test_dp_multinode.py): SIGTERM on the head aborts the node's requests too
(their ``abort`` outputs come back before the node closes); SIGTERM on the node drains
only its own requests, after its own timeout, and the head turns unhealthy.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.processes import child_env, free_port, wait_healthy
from tests.server.conftest import API_KEY, MODEL, SERVER_FLAGS, Server, start_server, stop_server

STREAMS = 8
NON_STREAMED = 8
EXIT_MARGIN_S = 30.0
"""After the drain: uvicorn's exit and the engine's shutdown (threads joined)."""


@pytest.fixture(params=[1, 2], ids=["dp1", "dp2"])
def data_parallel_size(request) -> int:
    return request.param


def _start(tiny_smollm2, tmp_path, dp: int, shutdown_timeout: float):
    flags = [str(tiny_smollm2[0]), *SERVER_FLAGS, "--data-parallel-size", str(dp)]
    flags += ["--shutdown-timeout", str(shutdown_timeout)]
    return start_server(tmp_path / "server.log", flags, num_cpu_devices=dp)


async def _stream(client, i: int, max_tokens: int) -> dict:
    """One chat stream, read raw: its chunks, its last data line, when it ended."""
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Story {i}: once upon a time"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as response:
        assert response.status_code == 200
        data = [line[6:] async for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {
        "last": data[-1],
        "finish_reason": [r for r in reasons if r is not None],
        "text": text,
        "tokens": usage[-1]["completion_tokens"] if usage else None,
        "ended": time.monotonic(),
    }


async def _complete(client, i: int, max_tokens: int) -> dict:
    out = await client.completions.create(
        model=MODEL,
        prompt=f"Request {i}: count to",
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    return {
        "finish_reason": [choice.finish_reason],
        "text": choice.text,
        "tokens": out.usage.completion_tokens,
        "ended": time.monotonic(),
    }


def _running(server) -> float:
    m = server.metrics()
    return m["jaxengine:num_requests_running"]


async def _sigterm_under_load(server, max_tokens: int) -> tuple[float, list[dict], dict]:
    """Starts the 16 requests, sends SIGTERM once all run, probes the server after it;
    (when the signal went, every request's result, the probes' responses)."""
    client = server.async_client(max_retries=0, timeout=300)
    tasks = [asyncio.ensure_future(_stream(client, i, max_tokens)) for i in range(STREAMS)]
    tasks += [asyncio.ensure_future(_complete(client, i, max_tokens)) for i in range(NON_STREAMED)]
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(_running, server) < STREAMS + NON_STREAMED:
        assert time.monotonic() < deadline, server.log_tail()
        assert not any(t.done() for t in tasks), "a request ended before the signal"
        await asyncio.sleep(0.05)
    signalled = time.monotonic()
    os.kill(server.process.pid, signal.SIGTERM)
    await asyncio.sleep(0.5)  # the server's loop takes the signal at once
    probes = {}
    async with httpx.AsyncClient(headers=server.headers, timeout=10) as http:
        probes["completion"] = await http.post(
            server.base_url + "/completions",
            json={"model": MODEL, "prompt": "late", "max_tokens": 2},
        )
        probes["health"] = await http.get(server.url + "/health")
    results = await asyncio.gather(*tasks)
    await client.close()
    return signalled, results, probes


def _check_refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]


def _exit_code(server, timeout: float) -> int:
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_server(server)
        pytest.fail(f"the server did not exit in {timeout:.0f}s:\n{server.log_tail()}")


def test_sigterm_lets_requests_in_flight_finish(tiny_smollm2, tmp_path, data_parallel_size):
    timeout, max_tokens = 120.0, 64
    server = _start(tiny_smollm2, tmp_path, data_parallel_size, timeout)
    try:
        signalled, results, probes = asyncio.run(_sigterm_under_load(server, max_tokens))
        _check_refused(probes["completion"])
        _check_refused(probes["health"])
        for result in results:
            assert result["finish_reason"] == ["length"], result
            assert result["tokens"] == max_tokens, result
            assert signalled < result["ended"] < signalled + timeout  # drained, not cut
        assert all(r["last"] == "[DONE]" for r in results[:STREAMS])
        assert _exit_code(server, timeout + EXIT_MARGIN_S) == 0, server.log_tail()
    finally:
        stop_server(server)
    assert "drained; shutting down" in server.log_tail(200)


def test_sigterm_aborts_what_outlasts_the_timeout(tiny_smollm2, tmp_path, data_parallel_size):
    timeout, max_tokens = 1.0, 448  # the tiny model needs far more than 1 s for this
    server = _start(tiny_smollm2, tmp_path, data_parallel_size, timeout)
    try:
        signalled, results, probes = asyncio.run(_sigterm_under_load(server, max_tokens))
        _check_refused(probes["completion"])
        for result in results:
            assert result["finish_reason"] == ["abort"], result
            assert 1 <= result["tokens"] < max_tokens, result
            assert result["ended"] < signalled + timeout + EXIT_MARGIN_S
        assert all(r["last"] == "[DONE]" for r in results[:STREAMS])
        assert _exit_code(server, timeout + EXIT_MARGIN_S) == 0, server.log_tail()
    finally:
        stop_server(server)
    assert "aborting the 16 requests still in flight" in server.log_tail(200)


# ---------------------------------------------------------------------- several nodes


def _start_head_and_node(children, tiny_smollm2, tmp_path, head_timeout, node_timeout):
    """A head (rank 0, the API) and a headless node (rank 1) of one data-parallel
    engine (as tests/server/test_dp_multinode.py), each with its ``--shutdown-timeout``;
    the head as a `Server` once healthy."""
    http, rpc = free_port(), free_port()
    serve = [sys.executable, "-m", "jaxengine.cli.main", "serve", str(tiny_smollm2[0])]
    serve += [*SERVER_FLAGS, "--no-background-compile", "--data-parallel-size", "2"]
    serve += ["--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1"]
    serve += ["--data-parallel-rpc-port", str(rpc)]
    env = child_env(JAX_NUM_CPU_DEVICES="1")
    head = children.start(
        "head",
        [*serve, "--shutdown-timeout", str(head_timeout), "--port", str(http)],
        env,
    )
    node = [*serve, "--shutdown-timeout", str(node_timeout), "--data-parallel-start-rank", "1"]
    children.start("node", [*node, "--headless"], env)
    url = f"http://127.0.0.1:{http}"
    wait_healthy(url, children, 300)
    return Server(url, API_KEY, head, tmp_path / "head.log")


@pytest.mark.slow
def test_sigterm_on_the_head_aborts_the_remote_nodes_requests_too(tiny_smollm2, children, tmp_path):
    """The head's abort reaches the headless node: its requests end with ``abort``
    outputs sent back before it closes (not a lost node's error), and both exit 0."""
    server = _start_head_and_node(children, tiny_smollm2, tmp_path, 1.0, 0.0)
    signalled, results, probes = asyncio.run(_sigterm_under_load(server, 448))
    _check_refused(probes["completion"])
    for result in results:
        assert result["finish_reason"] == ["abort"], (result, children.logs())
        assert result["ended"] < signalled + 1.0 + EXIT_MARGIN_S
    assert all(r["last"] == "[DONE]" for r in results[:STREAMS])
    assert children.wait("head", EXIT_MARGIN_S) == 0, children.logs()
    assert children.wait("node", EXIT_MARGIN_S) == 0, children.logs()


@pytest.mark.slow
def test_sigterm_on_a_headless_node_drains_its_requests(tiny_smollm2, children, tmp_path):
    """SIGTERM on the node: the requests it runs end with ``abort`` after its own
    timeout while the head's keep running; the node exits 0, the head's /health turns
    503 (a rank is gone); then the head drains the rest and exits 0."""
    server = _start_head_and_node(children, tiny_smollm2, tmp_path, 1.0, 1.0)
    node = children.procs["node"]

    async def run() -> tuple[float, float, list[dict]]:
        client = server.async_client(max_retries=0, timeout=300)
        tasks = [asyncio.ensure_future(_stream(client, i, 448)) for i in range(STREAMS)]
        tasks += [asyncio.ensure_future(_complete(client, i, 448)) for i in range(NON_STREAMED)]
        running = lambda: server.metrics(per_engine=True)  # noqa: E731
        deadline = time.monotonic() + 60
        while not all(
            await asyncio.to_thread(lambda: [_on_engine(running(), e) > 0 for e in "01"])
        ):
            assert time.monotonic() < deadline, children.logs()
            await asyncio.sleep(0.05)
        node_signalled = time.monotonic()
        node.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(node.wait, EXIT_MARGIN_S) == 0, children.logs()
        health = await asyncio.to_thread(httpx.get, server.url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        head_signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        await client.close()
        return node_signalled, head_signalled, results

    node_signalled, head_signalled, results = asyncio.run(run())
    assert all(r["finish_reason"] == ["abort"] for r in results), (results, children.logs())
    on_node = [r for r in results if r["ended"] < head_signalled]
    assert on_node and len(on_node) < len(results), [r["ended"] for r in results]
    assert all(r["ended"] > node_signalled + 1.0 for r in on_node)  # after its timeout
    assert all(r["last"] == "[DONE]" for r in results[:STREAMS])
    assert children.wait("head", EXIT_MARGIN_S) == 0, children.logs()


def _on_engine(samples: dict[str, float], engine: str) -> float:
    """The running requests of one replica, from per-engine `/metrics` samples."""
    name, label = "jaxengine:num_requests_running{", f'engine="{engine}"'
    return sum(v for k, v in samples.items() if k.startswith(name) and label in k)
