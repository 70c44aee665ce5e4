"""Admission control in the engine fronts, over fake engines (no model, no jax).

`AsyncLLM` refuses a request at ``--max-num-queued-reqs`` (n sequences counting n)
and ``--max-num-queued-tokens`` (the prompts of requests with no token yet, a
non-streamed one included: the engine thread reports first tokens, not the stream),
counts each refusal once, and admits again once the load falls; `DPAsyncLLM` checks
once for all its replicas, which check nothing themselves.

`FakeEngine` is the `LLMEngine` surface the fronts drive, on the real
`OutputProcessor`: a prompt is its token ids, a step gives every sequence one token,
and steps run only when the test grants them (`steps`), so "still prefilling" is a
state the test holds, not a race.
"""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from jaxengine.core.sched_output import EngineCoreOutput, SchedulerStats
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine_args import EngineArgs
from jaxengine.entrypoints.admission import REASONS, AdmissionRejectedError
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.dp_async_llm import DPAsyncLLM
from jaxengine.entrypoints.streams import Load
from jaxengine.inputs import PreparedPrompt
from jaxengine.sampling_params import RequestOutputKind, SamplingParams

REQS, TOKENS = REASONS


class FakeEngine:
    """One replica: requests wait until `grant` lets the engine thread step."""

    def __init__(self, config) -> None:
        self.config = config
        self.rollout = types.SimpleNamespace(check_awake=lambda: None, is_sleeping=lambda: False)
        self.outputs = OutputProcessor(tokenizer=None)
        self._lock = threading.Lock()
        self.steps = 0
        """Steps the engine thread may still run."""

    def grant(self, steps: int) -> None:
        with self._lock:
            self.steps += steps

    def prepare(self, prompt, params, lora_request=None) -> PreparedPrompt:
        return PreparedPrompt(None, list(prompt), params.clone(), None)

    def add_prepared(self, request_id, prepared, *, arrival_time=None, priority=0) -> None:
        p = prepared
        with self._lock:
            self.outputs.add(request_id, p.text, p.token_ids, p.params, arrival_time or 0.0, None)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self.outputs.by_child) and self.steps > 0

    def step(self) -> list:
        with self._lock:
            self.steps -= 1
            finished = {
                cid: len(seq.token_ids) + 1 >= seq.params.max_tokens
                for cid, (_, seq) in self.outputs.by_child.items()
            }
            outs = [
                EngineCoreOutput(cid, [7], "length" if done else None)
                for cid, done in finished.items()
            ]
            return self.outputs.process(outs)[0]

    def take_iteration_stats(self):
        with self._lock:
            return self.outputs.take_stats()

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 0, 0.0, 0, 0, 0)

    def abort_request(self, request_ids) -> None:
        with self._lock:
            for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
                self.outputs.abort(rid)

    def shutdown(self) -> None:
        pass


class FakeDPEngine:
    """A `DataParallelEngine` of fake replicas (prompts prepared by the first)."""

    def __init__(self, config) -> None:
        self.config = config
        size = config.parallel_config.data_parallel_size
        self.replicas = [FakeEngine(config) for _ in range(size)]
        self.prepare = self.replicas[0].prepare

    def shutdown(self) -> None:
        pass


def config(**caps):
    return EngineArgs(model="fake", block_size=16, **caps)._build()


def params(n: int = 1, kind=RequestOutputKind.DELTA, max_tokens: int = 50) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, output_kind=kind)


HELD: list = []
"""The open requests' streams: a stream nobody holds is collected, which closes it."""


async def opened(front, prompt: list[int], sampling: SamplingParams, rid: str):
    """The read of the request's first output, started and kept running (the request
    in flight) once the front has admitted and opened it."""
    stream = front.generate(prompt, sampling, rid)
    first = asyncio.ensure_future(anext(stream))
    HELD.append(stream)
    while front.streams.owner_of(rid) is None:
        if first.done():
            first.result()  # the refusal (or any error) surfaces here
        await asyncio.sleep(0.001)
    return first


async def refused(front, prompt: list[int], sampling: SamplingParams, rid: str) -> str:
    with pytest.raises(AdmissionRejectedError) as info:
        await anext(front.generate(prompt, sampling, rid))
    assert front.streams.owner_of(rid) is None  # nothing was opened or queued
    return info.value.reason


async def leave(first: asyncio.Future) -> None:
    """Cancels a stream's pending read, as a client that goes away: the stream ends."""
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def run_steps(front, engine: FakeEngine, steps: int) -> None:
    """Lets ``engine`` run ``steps`` steps and waits until it has."""
    engine.grant(steps)
    await front.abort("wake-up")  # a command wakes the idle engine thread at once
    while engine.steps > 0:
        await asyncio.sleep(0.001)


@pytest.fixture
def front_of():
    made = []

    def make(front_cls, engine_cls, **caps):
        cfg = config(**caps)
        engine = engine_cls(cfg)
        front = front_cls(cfg, engine=engine)
        made.append(front)
        return front, engine

    yield make
    HELD.clear()
    for front in made:
        front.shutdown(timeout=5)


def test_request_cap_counts_n_and_frees_on_close(front_of):
    llm, _ = front_of(AsyncLLM, FakeEngine, max_num_queued_reqs=3)

    async def run() -> None:
        first = await opened(llm, [1, 2], params(n=2), "a")
        assert llm.streams.load() == Load(2, 4)
        assert await refused(llm, [1], params(n=2), "b") == REQS  # 2 + 2 > 3
        await opened(llm, [1], params(), "c")  # 2 + 1 <= 3
        assert await refused(llm, [1], params(), "d") == REQS
        await leave(first)  # the client leaves: its two sequences are free again
        assert llm.streams.load().num_seqs == 1
        await opened(llm, [1], params(n=2), "e")

    asyncio.run(run())
    assert llm.admission_rejections() == {REQS: 2, TOKENS: 0}


def test_token_cap_weighs_prompts_until_their_first_token_even_unstreamed(front_of):
    llm, engine = front_of(AsyncLLM, FakeEngine, max_num_queued_tokens=10)
    final = params(kind=RequestOutputKind.FINAL_ONLY)

    async def run() -> None:
        await opened(llm, [1] * 6, final, "a")
        await opened(llm, [1] * 4, params(), "b")  # the backlog was 6 < 10
        assert llm.streams.load() == Load(2, 10)
        assert await refused(llm, [1], final, "c") == TOKENS
        await run_steps(llm, engine, 1)  # both got a token; "a" has shown nothing yet
        while llm.streams.load().num_prefill_tokens:
            await asyncio.sleep(0.001)
        assert llm.streams.load() == Load(2, 0)
        await opened(llm, [1] * 30, final, "d")  # admitted: the backlog it joins is 0

    asyncio.run(run())
    assert llm.admission_rejections() == {REQS: 0, TOKENS: 1}


def test_request_cap_is_checked_before_the_token_cap(front_of):
    llm, _ = front_of(AsyncLLM, FakeEngine, max_num_queued_reqs=1, max_num_queued_tokens=1)

    async def run() -> None:
        await opened(llm, [1, 2, 3], params(), "a")  # both caps reached
        assert await refused(llm, [1], params(), "b") == REQS

    asyncio.run(run())
    assert llm.admission_rejections() == {REQS: 1, TOKENS: 0}


def test_no_caps_by_default(front_of):
    llm, _ = front_of(AsyncLLM, FakeEngine)

    async def run() -> None:
        for i in range(20):
            await opened(llm, [1] * 100, params(n=4), f"r{i}")
        assert llm.streams.load() == Load(80, 8000)

    asyncio.run(run())
    assert llm.admission_rejections() == {REQS: 0, TOKENS: 0}


def test_data_parallel_caps_are_the_whole_front(front_of):
    dp, engine = front_of(DPAsyncLLM, FakeDPEngine, data_parallel_size=2, max_num_queued_reqs=2)
    assert all(replica.admission is None for replica in dp.replicas)

    async def run() -> None:
        await opened(dp, [1, 2], params(), "a")
        await opened(dp, [9, 8], params(), "b")
        assert sorted(dp.loads()) == [1, 1]  # one on each replica: each has room alone
        assert await refused(dp, [5], params(), "c") == REQS

    asyncio.run(run())
    assert dp.admission_rejections() == {REQS: 1, TOKENS: 0}
    assert all(replica.admission_rejections() == {} for replica in dp.replicas)
