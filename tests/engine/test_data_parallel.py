"""Data parallelism through `LLM`: replicas on their own devices, same greedy outputs.

`LLM(..., data_parallel_size=2)` builds two engines on the first two (virtual CPU)
devices. Its greedy outputs equal one engine's (the shared `tiny_llm`, on the same tiny
model), both replicas take requests, each replica's parameters live on its own device, and the `LLM`
behaviour around the engine (validation before queueing, chat, the tokenizer) holds.
Tensor x data parallelism is checked with the other layouts in
tests/sharding/test_parallel_engine.py.
"""

from __future__ import annotations

import asyncio
import re

import jax
import pytest

from jaxengine import LLM, SamplingParams, StructuredOutputsParams
from jaxengine.entrypoints.async_llm import EngineDeadError
from jaxengine.entrypoints.dp_async_llm import DPAsyncLLM
from jaxengine.sampling_params import RequestOutputKind
from tests.engine.conftest import small_llm_kwargs

pytestmark = pytest.mark.slow

PROMPTS = [
    {"prompt_token_ids": [504, 3575, 282, 4649, 314]},  # "The capital of France is"
    "1, 2, 3, 4,",
    "Hello, my name is",
    {"prompt_token_ids": [100 + 3 * i for i in range(40)]},  # longer than the budget
    "The quick brown fox",
    "Water boils at",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def param_devices(engine) -> set:
    return {d for leaf in jax.tree.leaves(engine.executor.runner.params) for d in leaf.devices()}


def count_adds(monkeypatch, dp_engine) -> list[int]:
    """Counts the requests each replica receives from now on."""
    counts = [0] * len(dp_engine.replicas)
    for i, replica in enumerate(dp_engine.replicas):
        add = replica.add_prepared

        def counted(*args, _i=i, _add=add, **kwargs):
            counts[_i] += 1
            return _add(*args, **kwargs)

        monkeypatch.setattr(replica, "add_prepared", counted)
    return counts


# ---------------------------------------------------------------------- tiny model, DP 2


@pytest.fixture(scope="module")
def dp_llm(tiny_smollm2, xla_cache_dir):
    """`tiny_llm`'s model and settings on two replicas."""
    kwargs = small_llm_kwargs(xla_cache_dir)
    llm = LLM(model=str(tiny_smollm2[0]), data_parallel_size=2, **kwargs)
    yield llm
    llm.shutdown()


def test_greedy_outputs_match_one_engine(tiny_llm, dp_llm, monkeypatch):
    counts = count_adds(monkeypatch, dp_llm.engine)
    expected = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.prompt for o in got] == [o.prompt for o in expected]
    assert sum(counts) == len(PROMPTS) and min(counts) >= 2, counts  # both took load
    assert not dp_llm.engine.has_unfinished_requests()
    assert dp_llm.engine.get_stats().kv_cache_usage == 0.0


def test_each_replica_lives_on_its_own_device(dp_llm):
    replicas = dp_llm.engine.replicas
    assert len(replicas) == 2
    for device, replica in zip(jax.devices()[:2], replicas, strict=True):
        assert param_devices(replica) == {device}
        assert {d for cache in replica.executor.runner.kv_caches for d in cache.devices()} == {
            device
        }


def test_bad_prompt_queues_nothing_on_any_replica(dp_llm):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        dp_llm.generate([*PROMPTS, {"prompt_token_ids": [7] * 200}], GREEDY, use_tqdm=False)
    assert not dp_llm.engine.has_unfinished_requests()


def test_chat_and_tokenizer(tiny_llm, dp_llm):
    assert dp_llm.get_tokenizer() is dp_llm.engine.replicas[0].tokenizer
    assert dp_llm.engine.config.parallel_config.data_parallel_size == 2
    conversations = [[{"role": "user", "content": q}] for q in ("Say hello.", "Count to 3.")]
    params = SamplingParams(temperature=0, max_tokens=6)
    got = dp_llm.chat(conversations, params, use_tqdm=False)
    expected = tiny_llm.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]


def test_structured_outputs_on_both_replicas(tiny_llm, dp_llm, monkeypatch):
    counts = count_adds(monkeypatch, dp_llm.engine)
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}(, [0-9]{2}){2}"),
    )
    got = dp_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    expected = tiny_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert all(re.fullmatch(r"[0-9]{2}(, [0-9]{2}){2}", o.outputs[0].text) for o in got)
    assert min(counts) >= 1, counts


def test_shared_prefix_stays_on_one_replica(dp_llm, monkeypatch):
    """Prefix affinity: prompts sharing 2 full blocks follow the first of them, as long
    as that replica is at most 2 requests busier (by load alone they would alternate)."""
    counts = count_adds(monkeypatch, dp_llm.engine)
    prefix = [200 + i for i in range(32)]
    prompts = [PROMPTS[0], *({"prompt_token_ids": [*prefix, tail]} for tail in (1, 2, 3))]
    dp_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert counts == [1, 3]


# ---------------------------------------------------------------------- the server's engine


@pytest.fixture
def dp_async(dp_llm):
    """`DPAsyncLLM` over `dp_llm`'s replicas: one engine thread each."""
    engine = dp_llm.engine
    wrapper = DPAsyncLLM(engine.config, engine=engine)
    yield wrapper
    wrapper.shutdown(shutdown_engine=False)
    for replica in engine.replicas:  # a failed test must not leak into the next
        replica.abort_request(list(replica.outputs.requests))
    assert not engine.has_unfinished_requests()


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_async_streams_spread_over_replicas(tiny_llm, dp_async, monkeypatch):
    counts = count_adds(monkeypatch, dp_async.engine)
    expected = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    params = GREEDY.clone()
    params.output_kind = RequestOutputKind.DELTA

    async def main():
        leaver = dp_async.generate("Once upon a time", params, "leaver")
        await anext(leaver)
        with pytest.raises(ValueError, match="duplicate request id"):
            await anext(dp_async.generate("Again", params, "leaver"))
        await leaver.aclose()  # aborts it on its replica
        return await asyncio.gather(
            *(_collect(dp_async, p, params, f"r{i}") for i, p in enumerate(PROMPTS))
        )

    streams = asyncio.run(asyncio.wait_for(main(), timeout=120))
    for outs, want in zip(streams, expected, strict=True):
        assert [t for o in outs for t in o.outputs[0].token_ids] == want.outputs[0].token_ids
    assert min(counts) >= 3, counts
    assert dp_async.num_requests() == 0


def test_a_failing_replica_makes_the_engine_unhealthy(dp_async, monkeypatch):
    def boom():
        raise RuntimeError("device lost")

    monkeypatch.setattr(dp_async.engine.replicas[0], "step", boom)  # the first pick

    async def main():
        await dp_async.check_health()
        params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(dp_async, "hi", params, "victim")
        with pytest.raises(EngineDeadError):
            await dp_async.check_health()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert dp_async.errored and not dp_async.is_running


# ---------------------------------------------------------------------- tiny Llama, TP 2 x DP 2
