"""`jaxengine run-batch`: good and bad lines of an OpenAI batch file, end to end.

One real process (the tiny model, `tiny_smollm2`, with lazy compilation) runs a file
that mixes valid completions and chat requests with every kind of bad line; the output
has one line per input line, in order, each with the right status or error, and the
good completion is transformers' greedy text of the same model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GOOD_COMPLETION = {
    "custom_id": "c1",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
}
GOOD_CHAT = {
    "custom_id": "c2",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    },
}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def batch_output(tiny_smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    lines = [
        json.dumps(GOOD_COMPLETION),
        "{not json",
        _line("bad-url", "/v1/embeddings", {"input": "x"}),
        _line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
        _line("bad-model", "/v1/completions", {"prompt": "x", "model": "nope"}),
        _line("too-long", "/v1/completions", {"prompt": "hi " * 300, "max_tokens": 300}),
        _line("no-body", "/v1/completions", None),
        "",
        json.dumps(GOOD_CHAT),
        _line("streamed", "/v1/chat/completions", {**GOOD_CHAT["body"], "stream": True}),
    ]
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "jaxengine.cli.main", "run-batch", "-i", str(src), "-o"]
    cmd += [
        str(dst),
        "--model",
        str(tiny_smollm2[0]),
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--max-num-seqs",
        "4",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in dst.read_text().splitlines()]


def test_one_output_line_per_request_in_order(batch_output):
    ids = [r["custom_id"] for r in batch_output]
    assert ids == ["c1", None, "bad-url", "bad-temp", "bad-model", "too-long", "no-body",
                   "c2", "streamed"]  # fmt: skip
    assert all(r["id"].startswith("batch_req_") for r in batch_output)


def test_good_lines_answer_like_the_server(batch_output, tiny_smollm2):
    from transformers import AutoTokenizer

    from tests.models.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm2[0])
    prompt = tokenizer.encode(GOOD_COMPLETION["body"]["prompt"])
    greedy = tokenizer.decode(hf_greedy(tiny_smollm2[1], prompt, 5), skip_special_tokens=True)
    completion, chat = batch_output[0], batch_output[7]
    for record in (completion, chat):
        assert record["error"] is None
        assert record["response"]["status_code"] == 200
    body = completion["response"]["body"]
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == greedy
    assert body["usage"]["completion_tokens"] == 5
    chat_body = chat["response"]["body"]
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["role"] == "assistant"
    assert chat_body["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("index", "status", "words"),
    [
        (3, 400, "temperature"),
        (4, 404, "does not exist"),
        (5, 400, "maximum context length is 512"),
        (8, 400, "stream"),
    ],
)
def test_rejected_requests_carry_their_status(batch_output, index, status, words):
    record = batch_output[index]
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == status
    error = response["body"]["error"]
    assert words in error["message"]
    assert error["code"] == status and error["type"]


@pytest.mark.parametrize(("index", "words"), [(1, "invalid JSON"), (2, "url"), (6, "body")])
def test_unparsable_lines_are_error_lines(batch_output, index, words):
    record = batch_output[index]
    assert record["response"] is None
    assert words in record["error"]["message"]
