"""Data-parallel replicas on two "nodes" behind one API server (vLLM's multi-node DP).

Two processes on loopback, one CPU device each, serving a tiny random Llama:

- the head: ``jaxengine serve --data-parallel-size 2 --data-parallel-size-local 1
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`` (rank 0, HTTP);
- a headless node: the same with ``--headless --data-parallel-start-rank 1``
  (rank 1, no HTTP), which registers with the head.

Concurrent greedy completions must give the tokens of one engine in this process,
`/metrics` must count finished requests on both ``engine="0"`` and ``engine="1"``,
and the node must exit 0 once the head stops. Every child's process group is killed
at the end, whatever happened.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx
import pytest
from tiny_models import tiny_llama_config

from jaxengine import LLM, SamplingParams
from tests.processes import child_env, free_port, wait_healthy
from tests.server.conftest import API_KEY, Server
from tests.server.test_data_parallel import SUCCESS, per_engine
from tests.server.test_endpoints import wait_for
from tests.sharding.conftest import ENGINE_KWARGS, PROMPTS, VOCAB, save_checkpoint

MAX_TOKENS = 8
TIMEOUT = 180  # seconds for both processes to load, compile and register

ENGINE_FLAGS = [
    "--skip-tokenizer-init",
    "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
    "--max-num-seqs", str(ENGINE_KWARGS["max_num_seqs"]),
    "--max-num-batched-tokens", str(ENGINE_KWARGS["max_num_batched_tokens"]),
    "--compile-token-buckets", *map(str, ENGINE_KWARGS["compile_token_buckets"]),
    "--no-enable-compilation-cache",
    "--swap-space", "0",
    "--disable-log-stats",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    config = tiny_llama_config(VOCAB)
    return save_checkpoint(config, tmp_path_factory.mktemp("dp_llama"))


def reference(model: str) -> list[list[int]]:
    """Greedy tokens of every prompt on one engine in this process."""
    llm = LLM(model=model, **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


async def complete_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """One completion request per prompt, all at once; each one's greedy token ids."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        response = await client.post(url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


@pytest.mark.slow
def test_head_and_headless_node_serve_one_api(tiny_llama, children, tmp_path):
    http, rpc = free_port(), free_port()
    serve = [sys.executable, "-m", "jaxengine.cli.main", "serve", tiny_llama, *ENGINE_FLAGS]
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    env = child_env(JAX_NUM_CPU_DEVICES="1")
    head = children.start(
        "head",
        [*serve, *dp, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(http)],
        env,
    )
    children.start("node", [*serve, *dp, "--data-parallel-start-rank", "1", "--headless"], env)
    expected = reference(tiny_llama)  # while the children start
    url = f"http://127.0.0.1:{http}"
    wait_healthy(url, children, TIMEOUT)

    prompts = [[int(t) for t in p] for p in PROMPTS] * 2
    tokens = asyncio.run(complete_all(url, prompts))
    assert tokens == expected * 2, children.logs()

    server = Server(url, API_KEY, head, tmp_path / "head.log")  # /metrics, unchecked
    finished = lambda: per_engine(server.metrics(per_engine=True), SUCCESS)  # noqa: E731
    assert wait_for(lambda: sum(finished().values()) == len(prompts)), finished()
    assert sorted(finished()) == ["0", "1"]
    assert all(count > 0 for count in finished().values()), finished()

    head.send_signal(signal.SIGINT)  # the head's shutdown tells the node to stop
    assert children.wait("node", 60) == 0, children.log("node")
    children.wait("head", 60)
