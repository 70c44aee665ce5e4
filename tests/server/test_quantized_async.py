"""`jaxengine serve` with int8 weights, an fp8 KV cache and async scheduling at once.

One server for the module: a chat completion, a stream and concurrent requests come
back whole (the quantized model still answers the capital of France), and the
server reports the fp8 cache on start-up.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import MODEL, SERVER_FLAGS, start_server, stop_server, with_flags
from tests.xla_effort import OPTIMIZED

FLAGS = ["--quantization", "int8", "--kv-cache-dtype", "fp8", "--async-scheduling"]
ONE_BUCKET = {
    "--max-num-seqs": "8",
    "--max-num-batched-tokens": "32",
    "--compile-token-buckets": "32",
}
"""One step shape of SmolLM2's 30 layers to compile instead of three (about 8 s each):
the test is about the quantized, asynchronous engine behind the API, not bucketing."""


def _flags() -> list[str]:
    return [*with_flags(SERVER_FLAGS, ONE_BUCKET), *FLAGS]


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server-quantized") / "server.log"
    # SmolLM2's decoding is most of this test's time (tests/xla_effort.py)
    running = start_server(log_path, _flags(), environ=OPTIMIZED)
    yield running
    stop_server(running)


def test_chat_stream_and_concurrent_requests(server):
    client = server.client(max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=16, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reply.choices[0].message.content

    async def many():
        async with server.async_client(max_retries=0, timeout=120) as aclient:
            calls = [
                aclient.completions.create(
                    model=MODEL,
                    prompt=f"{i} + {i} =",
                    max_tokens=8,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(6)
            ]
            return await asyncio.gather(*calls)

    outs = asyncio.run(many())
    assert [o.usage.completion_tokens for o in outs] == [8] * 6
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    log = server.log_path.read_text(errors="replace")
    assert "float8_e4m3fn" in log and "int8 weights" in log
