"""`jaxengine chat` / `jaxengine complete` against a fake OpenAI server, and the CLI's parser.

The fake is a FastAPI app with canned replies (streamed when asked), served by uvicorn
in a background thread on a free port; it records every request it receives.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxengine.cli.main import build_parser, main

MODEL = "fake-model"
PIECES = ["Hel", "lo", " there"]
REPLY = "".join(PIECES)


# --------------------------------------------------------------------------- fake server


def _sse(chunks: list[dict[str, Any]]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def _chat_chunks() -> list[dict[str, Any]]:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    deltas = [{"role": "assistant", "content": ""}] + [{"content": p} for p in PIECES]
    chunks = [head | {"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return chunks


def _completion_chunks() -> list[dict[str, Any]]:
    head = {"id": "t1", "object": "text_completion", "created": 0, "model": MODEL}
    return [
        head | {"choices": [{"index": 0, "text": p, "finish_reason": None, "logprobs": None}]}
        for p in PIECES
    ]


def _error(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    return JSONResponse(body, status_code=400)


def _record(path: str, body: dict[str, Any], request: Request) -> dict[str, Any]:
    return {"path": path, "body": body, "auth": request.headers.get("authorization")}


def make_app(received: list[dict[str, Any]]) -> FastAPI:
    """Canned OpenAI endpoints; each POST is appended to ``received``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        received.append(_record("chat", body, request))
        if body["messages"][-1]["content"] == "fail":
            return _error("bad message")
        if body.get("stream"):
            return StreamingResponse(_sse(_chat_chunks()), media_type="text/event-stream")
        message = {"role": "assistant", "content": REPLY}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        head = {"id": "c1", "object": "chat.completion", "created": 0, "model": MODEL}
        return head | {"choices": [choice]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append(_record("completions", body, request))
        if body.get("stream"):
            return StreamingResponse(_sse(_completion_chunks()), media_type="text/event-stream")
        choice = {"index": 0, "text": REPLY, "finish_reason": "length", "logprobs": None}
        head = {"id": "t1", "object": "text_completion", "created": 0, "model": MODEL}
        return head | {"choices": [choice]}

    return app


class ServerThread:
    """Runs ``app`` with uvicorn on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(base URL ending in /v1, the list of received requests)."""
    received: list[dict[str, Any]] = []
    with ServerThread(make_app(received)) as server:
        yield f"http://127.0.0.1:{server.port}/v1", received


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("JAXENGINE_API_KEY", raising=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- chat


def test_chat_quick_prints_the_reply(fake, capsys):
    url, received = fake
    received.clear()
    argv = ["chat", "--url", url, "--system-prompt", "Be brief.", "--quick", "Hi"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out == REPLY + "\n"
    [req] = received
    assert req["path"] == "chat" and req["auth"] == "Bearer EMPTY"
    assert req["body"]["model"] == MODEL  # the first model the server lists
    assert not req["body"].get("stream")
    assert req["body"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_chat_interactive_streams_and_keeps_the_history(fake, capsys, monkeypatch):
    url, received = fake
    received.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\n\nsecond\n"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert main(["chat", "--url", url, "--max-tokens", "7"]) == 0
    out = capsys.readouterr()
    # The blank line is skipped (no request); EOF ends the session.
    assert out.out == f"> {REPLY}\n> > {REPLY}\n> \n"
    assert f"Using model: {MODEL}" in out.err
    assert len(received) == 2
    assert all(r["body"]["stream"] and r["body"]["max_tokens"] == 7 for r in received)
    assert received[1]["auth"] == "Bearer sk-test"
    assert received[1]["body"]["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "second"},
    ]


def test_chat_interactive_reports_a_refused_message_and_goes_on(fake, capsys, monkeypatch):
    url, received = fake
    received.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("fail\nagain\n"))
    assert main(["chat", "--url", url, "--model-name", "mine"]) == 0
    out = capsys.readouterr()
    assert "error: the server answered HTTP 400: bad message" in out.err
    assert out.out.endswith(f"> {REPLY}\n> \n")
    assert received[-1]["body"]["model"] == "mine"
    # The refused message is not kept in the conversation.
    assert received[-1]["body"]["messages"] == [{"role": "user", "content": "again"}]


def test_chat_quick_error_answer_exits_1(fake, capsys):
    url, _ = fake
    assert main(["chat", "--url", url, "--quick", "fail"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: the server answered HTTP 400: bad message"


# --------------------------------------------------------------------------- complete


def test_complete_quick(fake, capsys, monkeypatch):
    url, received = fake
    received.clear()
    monkeypatch.setenv("JAXENGINE_API_KEY", "je-key")
    assert main(["complete", "--url", url, "-q", "Once upon", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out == REPLY + "\n"
    [req] = received
    assert req["path"] == "completions" and req["auth"] == "Bearer je-key"
    assert req["body"]["prompt"] == "Once upon" and req["body"]["max_tokens"] == 3


def test_complete_interactive_sends_independent_prompts(fake, capsys, monkeypatch):
    url, received = fake
    received.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\ntwo\n"))
    assert main(["complete", "--url", url, "--api-key", "cli-key"]) == 0
    assert capsys.readouterr().out == f"> {REPLY}\n> {REPLY}\n> \n"
    assert [r["body"]["prompt"] for r in received] == ["one", "two"]
    assert all(r["body"]["stream"] and r["auth"] == "Bearer cli-key" for r in received)


# --------------------------------------------------------------------------- unreachable


def test_unreachable_server_is_one_line_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["complete", "--url", url, "--quick", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the server at {url}")
    assert err.count("\n") == 1


def test_unreachable_server_from_the_command_line():
    url = f"http://127.0.0.1:{free_port()}/v1"
    cmd = [sys.executable, "-m", "jaxengine.cli.main", "chat", "--url", url, "--quick", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: cannot reach the server")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- the parser


def test_help_lists_the_new_subcommands():
    text = build_parser().format_help()
    for name in ("chat", "complete", "bench", "collect-env"):
        assert name in text


def test_client_flags_and_defaults():
    args = build_parser().parse_args(["chat"])
    assert args.url == "http://localhost:8000/v1"
    assert args.model_name is None and args.api_key is None and args.quick is None
    assert args.system_prompt is None
    args = build_parser().parse_args(["complete", "-q", "x", "--model-name", "m"])
    assert (args.quick, args.model_name) == ("x", "m")


def test_building_the_parser_imports_nothing_heavy():
    code = (
        "import sys, jaxengine.cli.main as m; m.build_parser(); "
        "print(sorted(n for n in ('jax', 'numpy', 'openai', 'httpx') if n in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "'jax'" not in proc.stdout
    # This module's own subcommands import none of them.
    mine = ["jaxengine.cli.openai_clients", "jaxengine.cli.collect_env", "jaxengine.cli.bench"]
    code = (
        f"import sys, jaxengine.cli.main as m; m.build_parser({mine!r}); "
        "print(sorted(n for n in ('jax', 'numpy', 'openai', 'httpx') if n in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
