"""The serving benchmark (`bench.serve*`): workloads, schedule, metrics, and a whole run.

The pure pieces are tested on their own with a word-level fake tokenizer; the whole
benchmark runs against a fake streaming OpenAI server (FastAPI + uvicorn in a thread).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from jaxengine.benchmarks import serve, throughput
from jaxengine.benchmarks.serve_client import (
    DONE,
    RequestResult,
    chunk_text,
    parse_sse_line,
    run_requests,
)
from jaxengine.benchmarks.serve_datasets import (
    arrival_times,
    length_range,
    sample_random,
    sample_sharegpt,
    sharegpt_pairs,
    vocab_pool,
)
from jaxengine.benchmarks.serve_metrics import aggregate, format_report
from jaxengine.cli.main import build_parser
from jaxengine.cli.main import main as cli_main

MODEL = "fake-model"


class WordTokenizer:
    """Word-level: ids 0-2 are special, 3.. are ``w3``, ``w4``, ...; unknown words -> 2."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict[int, Any] = {}

    def __init__(self, size: int = 200) -> None:
        self.words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, size)]
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.index.get(w, 2) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


# --------------------------------------------------------------------------- datasets


def test_length_range():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(1, 0.9) == (1, 2)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_prompts_have_lengths_in_range_and_no_special_tokens():
    tok = WordTokenizer()
    assert vocab_pool(tok) == list(range(3, 200))
    reqs = sample_random(tok, 64, input_len=20, output_len=10, range_ratio=0.5, seed=1)
    assert len(reqs) == 64
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5  # lengths do vary
    assert all(r.prompt_len == len(tok.encode(r.prompt)) for r in reqs)
    assert not any("<" in r.prompt for r in reqs)
    assert reqs == sample_random(tok, 64, 20, 10, 0.5, seed=1)
    assert reqs != sample_random(tok, 64, 20, 10, 0.5, seed=2)


def test_random_prefix_is_shared():
    reqs = sample_random(WordTokenizer(), 8, input_len=5, output_len=3, prefix_len=4, seed=0)
    prefixes = {tuple(r.prompt.split()[:4]) for r in reqs}
    assert len(prefixes) == 1
    assert all(r.prompt_len == 9 and r.expected_output_len == 3 for r in reqs)
    assert len({r.prompt for r in reqs}) == 8


def test_random_prompts_with_a_real_bpe_tokenizer(smollm2_tokenizer):
    reqs = sample_random(smollm2_tokenizer, 4, input_len=32, output_len=8, seed=0)
    for r in reqs:
        assert 0 < r.prompt_len <= 32
        assert len(smollm2_tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def _conversation(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def _words(n: int, start: int = 3) -> str:
    return " ".join(f"w{start + i % 150}" for i in range(n))


def test_sharegpt_pairs_take_the_first_human_turn_and_its_reply():
    data = [
        _conversation(("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d")),
        _conversation(("system", "s"), ("human", "q"), ("gpt", "r")),
        _conversation(("human", "unanswered")),
        _conversation(("gpt", "no question")),
        {"id": "no conversations"},
    ]
    assert sharegpt_pairs(data) == [("a", "b"), ("q", "r")]


def test_sharegpt_sampling_filters_and_repeats(tmp_path):
    data = [
        _conversation(("human", _words(10)), ("gpt", _words(6))),  # kept
        _conversation(("human", _words(12)), ("gpt", _words(20))),  # kept
        _conversation(("human", _words(3)), ("gpt", _words(50))),  # prompt too short
        _conversation(("human", _words(8)), ("gpt", _words(2))),  # reply too short
        _conversation(("human", _words(1100)), ("gpt", _words(8))),  # prompt too long
        _conversation(("human", _words(1000)), ("gpt", _words(1100))),  # total too long
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tok = WordTokenizer()
    reqs = sample_sharegpt(path, tok, num=2, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(10, 6), (12, 20)]
    # A fixed output length replaces the reply's: the short reply and the long one pass.
    fixed = sample_sharegpt(path, tok, num=4, seed=0, output_len=5)
    assert sorted(r.prompt_len for r in fixed) == [8, 10, 12, 1000]
    assert all(r.expected_output_len == 5 for r in fixed)
    many = sample_sharegpt(path, tok, num=7, seed=0)  # only 2 usable: repeated
    assert len(many) == 7 and {r.prompt_len for r in many} == {10, 12}
    path.write_text(json.dumps(data[2:4]))
    with pytest.raises(ValueError, match="no usable conversation"):
        sample_sharegpt(path, tok, num=1)


# --------------------------------------------------------------------------- schedule


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness):
    times = arrival_times(20_000, request_rate=10.0, burstiness=burstiness, seed=0)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # Gamma(k) gaps: coefficient of variation 1 / sqrt(k) (1 for a Poisson process).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert times == arrival_times(20_000, 10.0, burstiness, seed=0)
    assert times != arrival_times(20_000, 10.0, burstiness, seed=1)


def test_bad_rates_are_rejected():
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0.0)


def test_requests_follow_arrivals_and_the_concurrency_cap():
    started: dict[int, float] = {}
    in_flight = [0, 0]  # now, most

    async def send(i: int) -> RequestResult:
        started[i] = time.perf_counter()
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        return RequestResult(prompt_len=i, success=True)

    arrivals = [0.0, 0.0, 0.0, 0.0, 0.0, 0.1]
    start = time.perf_counter()
    results, duration = asyncio.run(run_requests(send, arrivals, max_concurrency=2))
    assert [r.prompt_len for r in results] == list(range(6))  # in request order
    assert in_flight[1] == 2
    assert started[5] - start >= 0.1 - 1e-3
    assert 0.1 <= duration < 2.0


# --------------------------------------------------------------------------- SSE


def test_sse_lines():
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data: {"a": 1}\n') == {"a": 1}
    with pytest.raises(ValueError):
        parse_sse_line("data: {broken")
    chat = {"choices": [{"delta": {"content": "hi"}}]}
    assert chunk_text(chat, chat=True) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""
    assert chunk_text({"choices": [{"text": "yo"}]}, chat=False) == "yo"
    assert chunk_text({"choices": [], "usage": {}}, chat=False) == ""


# --------------------------------------------------------------------------- metrics


def _records() -> list[RequestResult]:
    return [
        RequestResult(10, True, 5, ttft=0.1, itl=[0.05] * 4, latency=0.3),
        RequestResult(20, True, 3, ttft=0.2, itl=[0.1, 0.3], latency=0.6),
        RequestResult(30, True, 1, ttft=0.4, itl=[], latency=0.4),
        RequestResult(40, False, error="HTTP 500"),
    ]


def test_aggregate_on_synthetic_records():
    m = aggregate(_records(), duration=2.0, percentiles=[50, 99, 99.9])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 400], 99))
    # TPOT only over requests with >= 2 output tokens: (0.3-0.1)/4 and (0.6-0.2)/2.
    assert m["mean_tpot_ms"] == pytest.approx((50 + 200) / 2)
    itls = [50] * 4 + [100, 300]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p99.9_itl_ms"] == pytest.approx(np.percentile(itls, 99.9))
    assert m["p50_e2el_ms"] == pytest.approx(400)


def test_aggregate_with_nothing_successful_reports_zeros():
    m = aggregate([RequestResult(5, False, error="x")], duration=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["output_throughput"] == 0
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0


def test_report_block():
    m = aggregate(_records(), duration=2.0, percentiles=[90, 99.9])
    text = format_report(m, ["ttft", "e2el"], [90, 99.9], request_rate=4.0, max_concurrency=8)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     3" in lines
    assert "Failed requests:                         1" in lines
    assert "Maximum request concurrency:             8" in lines
    assert "Request throughput (req/s):              1.50" in lines
    assert "Output token throughput (tok/s):         4.50" in lines
    assert "---------------Time to First Token----------------" in lines
    assert f"P99.9 E2EL (ms):{'':25}{m['p99.9_e2el_ms']:.2f}" in lines
    assert "Mean TTFT (ms):                          233.33" in lines
    assert not any("TPOT" in line or "ITL" in line for line in lines)


# --------------------------------------------------------------------------- flags


def test_flags_and_urls():
    args = serve.build_parser().parse_args([])
    assert args.num_prompts == 1000 and math.isinf(args.request_rate)
    assert args.percentile_metrics == ["ttft", "tpot", "itl"]
    assert args.metric_percentiles == [99.0]
    target = serve.resolve_target(args)
    assert target.api_url == "http://127.0.0.1:8000/v1/completions" and not target.chat
    assert target.models_url == "http://127.0.0.1:8000/v1/models"
    argv = ["--backend", "openai-chat", "--base-url", "http://h:9/v1/"]
    target = serve.resolve_target(serve.build_parser().parse_args(argv))
    assert target.api_url == "http://h:9/v1/chat/completions" and target.chat
    argv = ["--percentile-metrics", "e2el,TTFT", "--metric-percentiles", "50,99.9"]
    args = serve.build_parser().parse_args(argv)
    assert args.percentile_metrics == ["e2el", "ttft"] and args.metric_percentiles == [50, 99.9]
    for bad in (["--percentile-metrics", "ttft,foo"], ["--metric-percentiles", "0"]):
        with pytest.raises(SystemExit):
            serve.build_parser().parse_args(bad)


def test_sampling_fields_with_extra_body():
    argv = ["--ignore-eos", "--top-k", "5", "--extra-body", '{"logit_bias": {"2": -100}}']
    fields = serve.sampling_fields(serve.build_parser().parse_args(argv))
    assert fields == {
        "temperature": 0.0,
        "top_k": 5,
        "ignore_eos": True,
        "logit_bias": {"2": -100},
    }
    for bad in ("[1]", "{nope"):
        with pytest.raises(SystemExit):
            serve.build_parser().parse_args(["--extra-body", bad])


def test_bench_help_and_same_flags_as_the_modules(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in ("serve", "throughput", "latency"))

    def flags(parser) -> set[str]:
        return {s for a in parser._actions for s in a.option_strings}

    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    benches = sub._subparsers._group_actions[0].choices
    assert flags(benches["serve"]) == flags(serve.build_parser())
    assert flags(benches["throughput"]) == flags(throughput.build_parser())


def test_latency_rejects_negative_warmup_at_parse_time(capsys):
    from jaxengine.benchmarks import latency

    with pytest.raises(SystemExit):
        latency.build_parser().parse_args(["--num-iters-warmup", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- a whole run


def make_app(state: dict[str, Any]) -> FastAPI:
    """Streams ``max_tokens`` one-word chunks, then usage (unless state["usage"] is off)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> Any:
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        n = body.get("max_completion_tokens") or body["max_tokens"]
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        try:
            for i in range(n):
                await asyncio.sleep(0.002)
                word = f"w{i + 3} "
                choice = {"index": 0, "delta": {"content": word}} if chat else {"text": word}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if state["usage"]:
                usage = {"prompt_tokens": len(prompt.split()) + 1, "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        return StreamingResponse(stream(body, chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        return StreamingResponse(stream(body, chat=True), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, dict[str, Any]]]:
    state: dict[str, Any] = {"bodies": [], "in_flight": 0, "most": 0, "usage": True}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def state(fake_server, monkeypatch):
    """The fake's state, reset; the benchmark gets the word tokenizer."""
    _, st = fake_server
    st.update(bodies=[], most=0, usage=True)
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    return st


def test_whole_run_through_the_cli(fake_server, state, tmp_path, capsys):
    url, _ = fake_server
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", "12"]
    argv += ["--random-input-len", "16", "--random-output-len", "5", "--ignore-eos"]
    argv += ["--request-rate", "200", "--max-concurrency", "3", "--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    argv += ["--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Successful requests:                     12\n" in out
    assert "Total generated tokens:                  60\n" in out
    for label in ("P50 TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "Mean E2EL (ms):"):
        assert label in out

    bodies = state["bodies"]
    assert len(bodies) == 13  # the test request, then the 12
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] and b["temperature"] == 0.0 for b in bodies)
    assert all(b["model"] == MODEL for b in bodies)
    assert state["most"] <= 3

    [path] = tmp_path.glob("openai-200.0qps-concurrency3-fake-model-*.json")
    doc = json.loads(path.read_text())
    assert doc["completed"] == 12 and doc["failed"] == 0
    assert doc["total_output_tokens"] == 60
    assert doc["total_input_tokens"] == 12 * 17  # the server's count (16 words + 1)
    assert doc["request_rate"] == 200.0 and doc["max_concurrency"] == 3
    assert doc["config"]["random_input_len"] == 16 and "date" in doc
    assert doc["command"].startswith("jaxengine ")
    assert doc["output_lens"] == [5] * 12 and len(doc["itls"][0]) == 4
    assert doc["mean_tpot_ms"] > 0 and doc["p99_e2el_ms"] >= doc["p50_e2el_ms"]


def test_chat_sharegpt_run_without_usage_counts_with_the_tokenizer(fake_server, state, tmp_path):
    url, _ = fake_server
    state["usage"] = False
    data = [_conversation(("human", _words(8, i)), ("gpt", _words(4))) for i in range(3, 6)]
    dataset = tmp_path / "sg.json"
    dataset.write_text(json.dumps(data))
    argv = ["--backend", "openai-chat", "--base-url", url, "--dataset-name", "sharegpt"]
    argv += ["--dataset-path", str(dataset), "--num-prompts", "3", "--disable-tqdm"]
    argv += ["--save-result", "--result-filename", "r.json", "--result-dir", str(tmp_path)]
    assert serve.main(argv) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["backend"] == "openai-chat" and doc["completed"] == 3
    assert doc["total_output_tokens"] == 12 and doc["total_input_tokens"] == 24
    assert "output_lens" not in doc  # no --save-detailed
    assert all(b["max_completion_tokens"] == 4 and "messages" in b for b in state["bodies"])


def test_unreachable_server_is_one_line(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert serve.main(["--port", str(port), "--num-prompts", "2", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot list the server's models")
    assert err.count("\n") == 1
