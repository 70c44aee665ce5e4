"""vLLM's development routes on the shared server (one and two replicas): sleep and
wake, pause and resume with a request in flight, prefix-cache reset, weight updates
from a checkpoint path, ``/collective_rpc``.

Every test leaves the server awake and unpaused (the other server tests share it).
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.server.conftest import MODEL

PROMPT = "Once upon a time"


def greedy(server, max_tokens: int = 8) -> list[int]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


class Streamed(threading.Thread):
    """A streamed completion of ``max_tokens`` (EOS ignored) on its own thread: its
    chunks' texts and last finish reason."""

    def __init__(self, server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = server.client(max_retries=0, timeout=120)
        self.max_tokens = max_tokens
        self.chunks: list[str] = []
        self.finish_reason = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        stream = self.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=self.max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            self.chunks.append(chunk.choices[0].text)
            self.started.set()
            self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason


def sleep_states(server) -> dict[str, float]:
    """vLLM's ``engine_sleep_state`` gauge by its ``sleep_state`` label, engines summed."""
    found = {}
    for key, value in server.metrics().items():
        if key.startswith("vllm:engine_sleep_state{"):
            found[key.split('sleep_state="')[1].split('"')[0]] = value
    return found


def test_sleep_refuses_generation_and_wake_up_answers_the_same(server):
    want = greedy(server)
    engines = server.data_parallel_size
    assert sleep_states(server) == {"awake": engines, "weights_offloaded": 0, "discard_all": 0}
    assert server.post("/sleep?level=1", {}).status_code == 200
    try:
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep = {"awake": 0, "weights_offloaded": engines, "discard_all": 0}
        assert sleep_states(server) == asleep
        assert server.get("/health").status_code == 200
        refused = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert refused.status_code == 503
        assert "asleep" in refused.json()["error"]["message"]
    finally:
        assert server.post("/wake_up", {}).status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_states(server)["awake"] == engines
    assert greedy(server) == want


def test_wake_up_by_tags(server):
    want = greedy(server)
    assert server.post("/sleep?level=1", {}).status_code == 200
    try:
        assert server.post("/wake_up?tags=weights", {}).status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}  # KV cache asleep
        bad = server.post("/wake_up?tags=everything", {})
        assert bad.status_code == 400 and "wake_up tags" in bad.text
    finally:
        assert server.post("/wake_up?tags=kv_cache", {}).status_code == 200
    assert greedy(server) == want


def test_pause_keep_holds_a_request_in_flight_and_resume_finishes_it(server):
    want = greedy(server, 64)
    stream = Streamed(server, 64)
    assert stream.started.wait(60)
    assert server.post("/pause?mode=keep", {}).status_code == 200
    try:
        assert server.get("/is_paused").json() == {"is_paused": True}
        held = len(stream.chunks)
        time.sleep(1.0)
        assert len(stream.chunks) == held  # nothing steps while paused
        # weights may change under held requests: the same checkpoint, read again
        updated = server.post("/update_weights", {})
        assert updated.status_code == 200
        changed = updated.json()["updated"]
        assert len(changed) == server.data_parallel_size and min(changed) > 0
    finally:
        assert server.post("/resume", {}).status_code == 200
    stream.join(60)
    assert stream.finish_reason == "length"
    assert server.get("/is_paused").json() == {"is_paused": False}
    assert greedy(server, 64) == want


def test_pause_abort_ends_the_request_in_flight(server):
    stream = Streamed(server, 400)
    assert stream.started.wait(60)
    assert server.post("/pause?mode=abort", {}).status_code == 200
    stream.join(60)
    assert not stream.is_alive()
    assert stream.finish_reason == "abort"
    assert server.post("/resume", {}).status_code == 200
    assert len(greedy(server)) == 8


def test_pause_wait_returns_once_the_request_finished(server):
    stream = Streamed(server, 48)
    assert stream.started.wait(60)
    assert server.post("/pause?mode=wait", {}).status_code == 200
    try:
        stream.join(1.0)
        assert stream.finish_reason == "length"  # it ran to its end before the pause
    finally:
        assert server.post("/resume", {}).status_code == 200


def test_busy_engine_refuses_sleep(server):
    stream = Streamed(server, 400)
    assert stream.started.wait(60)
    try:
        refused = server.post("/sleep?level=1", {})
        assert refused.status_code == 409 and "running" in refused.text
    finally:
        stream.join(120)
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.parametrize("server", [1], ids=["dp1"], indirect=True)
def test_collective_rpc_and_weight_update_errors(server, tmp_path):
    rpc = server.post("/collective_rpc", {"method": "reset_prefix_cache"})
    assert rpc.status_code == 200 and rpc.json() == {"results": [True]}
    unknown = server.post("/collective_rpc", {"method": "load_model"})
    assert unknown.status_code == 400 and "unknown method 'load_model'" in unknown.text
    missing = server.post("/update_weights", {"path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "nowhere" in missing.text
    assert server.post("/reset_prefix_cache", {}).status_code == 200
    assert len(greedy(server)) == 8
