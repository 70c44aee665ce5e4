"""Admission control end to end: ``--max-num-queued-reqs`` answers HTTP 503.

On the shared `vllm_extras_server` (its cap: `MAX_NUM_QUEUED_REQS` sequences in
flight), with no server of its own: a request of more sequences than the cap is
refused before its response starts, streamed or not, the server goes on serving,
and ``vllm:admission_rejections_total`` counts each refusal once; a long streamed
request holding every slot makes the next one a 503 until its client leaves. The
rule itself (the token cap, n, the order of the caps) is tested without a model in
tests/unit/test_admission.py and test_admission_fronts.py.
"""

from __future__ import annotations

import httpx

from tests.server.conftest import MAX_NUM_QUEUED_REQS, MODEL
from tests.server.test_endpoints import wait_for

CAP = MAX_NUM_QUEUED_REQS
REFUSED = f'vllm:admission_rejections_total{{model_name="{MODEL}",reason="max_num_queued_reqs"}}'
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 1.0, "seed": 0}


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and "try again" in error["message"].lower()


def test_more_sequences_than_the_cap_is_a_503_streamed_or_not(vllm_extras_server):
    server = vllm_extras_server
    before = server.metrics()[REFUSED]
    assert_refused(server.post("/v1/completions", {**BODY, "n": CAP + 1}))
    assert_refused(server.post("/v1/completions", {**BODY, "n": CAP + 1, "stream": True}))
    assert server.metrics()[REFUSED] == before + 2  # once per request, not per sequence
    assert server.post("/v1/completions", {**BODY, "n": CAP}).status_code == 200


def test_a_request_in_flight_holds_its_slots_until_it_ends(vllm_extras_server):
    server = vllm_extras_server
    long = {**BODY, "n": CAP, "max_tokens": 400, "stream": True, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    before = server.metrics()[REFUSED]
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=long, headers=server.headers, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # held open: a closed iterator would close the stream
        assert next(line for line in lines if line).startswith("data: {")
        assert_refused(server.post("/v1/chat/completions", chat))  # every slot is taken
    assert server.metrics()[REFUSED] == before + 1
    # its client left: the server aborts it and the slots are free again
    assert wait_for(lambda: server.post("/v1/chat/completions", chat).status_code == 200, 30)
