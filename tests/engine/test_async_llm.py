"""`AsyncLLM`: the engine on its own thread, streaming to asyncio callers.

Runs on the shared tiny engine (`tiny_llm`): streamed deltas add up to what `LLM.generate`
returns, concurrent callers are batched, leaving a stream early frees the request's
pages, bad input fails before anything is queued, a failing step is reported to
every waiting caller and to `check_health` instead of hanging them, and as a
data-parallel rank it keeps its streams in the table it shares, under its rank.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxengine import SamplingParams
from jaxengine.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxengine.entrypoints.streams import StreamTable
from jaxengine.sampling_params import RequestOutputKind

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Hello, my name is"]


@pytest.fixture
def async_llm(tiny_llm):
    engine = tiny_llm.engine
    wrapper = AsyncLLM(engine.config, engine=engine)
    yield wrapper
    wrapper.shutdown(shutdown_engine=False)
    leftover = list(engine.outputs.requests)
    engine.abort_request(leftover)  # a failed test must not leak into the next
    assert not engine.has_unfinished_requests()


def _greedy(kind: RequestOutputKind, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=kind)


async def _collect(engine: AsyncLLM, prompt: str, params: SamplingParams, rid: str):
    outputs = []
    async for out in engine.generate(prompt, params, rid):
        outputs.append(out)
    return outputs


def _wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture
def offline_outputs(tiny_llm):
    """`LLM.generate` on the shared engine, before `async_llm`'s thread steps it too
    (requested first, so it runs first)."""
    return tiny_llm.generate(PROMPTS, _greedy(RequestOutputKind.FINAL_ONLY), use_tqdm=False)


def test_streamed_deltas_match_offline_generate(offline_outputs, async_llm):
    expected = offline_outputs

    async def main():
        params = _greedy(RequestOutputKind.DELTA)
        return await asyncio.gather(
            *(_collect(async_llm, p, params, f"r{i}") for i, p in enumerate(PROMPTS))
        )

    streams = asyncio.run(main())
    for outs, want in zip(streams, expected, strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        text = "".join(o.outputs[0].text for o in outs if o.outputs)
        ids = [t for o in outs if o.outputs for t in o.outputs[0].token_ids]
        assert text == want.outputs[0].text
        assert ids == list(want.outputs[0].token_ids)


def test_leaving_a_stream_aborts_and_frees_pages(tiny_llm, async_llm):
    async def main():
        params = _greedy(RequestOutputKind.DELTA, max_tokens=100)
        params.ignore_eos = True
        stream = async_llm.generate("Once upon a time", params, "leaver")
        first = await anext(stream)
        await stream.aclose()
        return first

    first = asyncio.run(main())
    assert not first.finished
    _wait_idle(tiny_llm.engine)
    stats = tiny_llm.engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert async_llm.num_requests() == 0


def test_bad_prompt_fails_before_queueing(async_llm):
    async def main():
        params = SamplingParams(max_tokens=10_000)
        with pytest.raises(ValueError, match="maximum context length is 128"):
            async for _ in async_llm.generate("hi", params, "too-long"):
                pass

    asyncio.run(main())
    assert async_llm.num_requests() == 0
    assert not async_llm.engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(async_llm):
    async def main():
        params = _greedy(RequestOutputKind.FINAL_ONLY, max_tokens=30)
        first = asyncio.ensure_future(_collect(async_llm, "a", params, "same"))
        await asyncio.sleep(0)  # let the first open its stream
        with pytest.raises(ValueError, match="duplicate request id"):
            await _collect(async_llm, "b", params, "same")
        return await first

    outs = asyncio.run(main())
    assert outs[-1].finished


def test_failing_step_reaches_callers_and_health(async_llm, monkeypatch):
    def boom():
        raise RuntimeError("device lost")

    monkeypatch.setattr(async_llm.engine, "step", boom)

    async def main():
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(async_llm, "hi", _greedy(RequestOutputKind.DELTA), "victim")
        with pytest.raises(EngineDeadError):
            await async_llm.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(async_llm, "hi", _greedy(RequestOutputKind.DELTA), "late")

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert async_llm.errored and not async_llm.is_running


def test_a_rank_keeps_its_streams_in_the_shared_table(tiny_llm):
    table = StreamTable()
    engine = tiny_llm.engine
    rank = AsyncLLM(engine.config, engine=engine, rank=3, streams=table)
    assert rank.generation_config is engine.generation_config

    async def main():
        params = _greedy(RequestOutputKind.DELTA, max_tokens=50)
        params.ignore_eos = True
        stream = rank.generate("Once upon a time", params, "mine")
        await anext(stream)
        seen = (table.owner_of("mine"), table.counts(), rank.num_requests())
        await rank.abort("mine")  # ends the stream here at once
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(main(), timeout=30))
        assert seen == (3, {3: 1}, 1)
        assert table.count() == 0
        _wait_idle(engine)
        assert not engine.has_unfinished_requests()
    finally:
        rank.shutdown(shutdown_engine=False)
