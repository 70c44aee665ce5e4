"""Async scheduling (``--async-scheduling``) against the shared synchronous engine.

Both on the tiny model (`tiny_llm`: async scheduling is about the scheduler and the
step's inputs, not the weights). One engine with the shared engine's settings plus
async scheduling: every step is
scheduled and dispatched while the device runs the one before, with the token still
in flight fed on device. Its outputs must be those of the synchronous engine for every
sampling feature (seeded random draws, min_tokens, stop strings and token ids,
logprobs, n, penalties, which fall back to synchronous steps), through preemption
(its KV cache is smaller than the shared engine's), and with a request aborted while
its step is in flight.
"""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams
from tests.engine.conftest import small_llm_kwargs
from tests.xla_effort import optimized

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "1 2 3 4",
    "Q: Why is the sea salty?\nA:",
    "A list of fruits:",
    "The quick brown fox",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.8, seed=7, max_tokens=25),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=30, min_tokens=10),
    SamplingParams(temperature=0, max_tokens=15, logprobs=3),
    SamplingParams(temperature=0.7, seed=11, max_tokens=20, stop=[" the"]),
    SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[13], ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=40, n=2),
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
]


@pytest.fixture(scope="module")
def async_llm(tiny_smollm2, xla_cache_dir):
    kwargs = {
        **small_llm_kwargs(xla_cache_dir),
        "async_scheduling": True,
        "num_gpu_blocks_override": 10,  # preempts under PARAMS (outputs must not change)
    }
    with optimized():  # compared token for token, logprobs too, with `tiny_llm`'s
        llm = LLM(model=str(tiny_smollm2[0]), **kwargs)
    yield llm
    llm.engine.shutdown()


def _spy_submits(engine) -> list:
    """Records every SchedulerOutput the engine submits."""
    seen, submit = [], engine.executor.submit

    def spy(out):
        seen.append(out)
        return submit(out)

    engine.executor.submit = spy
    return seen


def _fed(out) -> int:
    """Scheduled positions whose token was still in flight (fed on device)."""
    return sum(
        out.num_scheduled_tokens[c.req_id] - len(c.new_token_ids) for c in out.scheduled_cached_reqs
    )


def _results(outputs) -> list:
    return [
        [(o.token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs) for o in r.outputs]
        for r in outputs
    ]


def test_outputs_match_the_synchronous_engine(tiny_llm, async_llm):
    engine = async_llm.engine
    submitted = _spy_submits(engine)
    preemptions = engine.get_stats().num_preemptions
    expected = tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = async_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _results(got) == _results(expected)
    assert sum(_fed(o) for o in submitted) > 0
    assert engine.get_stats().num_preemptions > preemptions  # the small cache preempts
    penalized = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)] * 2
    want = tiny_llm.generate(PROMPTS[:2], penalized, use_tqdm=False)
    submitted.clear()
    assert _results(async_llm.generate(PROMPTS[:2], penalized, use_tqdm=False)) == _results(want)
    assert sum(_fed(o) for o in submitted) == 0  # penalties read outputs on the host
    assert engine.executor.compiles_after_warmup == 0
    assert engine.get_stats().kv_cache_usage == 0.0


def test_abort_while_its_step_is_in_flight(tiny_llm, async_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = tiny_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    engine = async_llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", prompt, params)
    finished = {}

    def step():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)

    for _ in range(4):
        step()
    assert engine._in_flight is not None
    engine.abort_request("abort-1")
    while engine.has_unfinished_requests():
        step()
    assert sorted(finished) == ["abort-0", "abort-2"]
    for rid, want in (("abort-0", expected[0]), ("abort-2", expected[2])):
        assert finished[rid].outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.get_stats().kv_cache_usage == 0.0


def test_the_sampler_programs_are_the_other_engines(async_llm, tiny_llm):
    """Two engines of one process with the same vocabulary, slots and placement run the
    same sampler executables: the second built traced and compiled none of them
    (`runner.executables.process_shared`)."""
    ours = async_llm.engine.executor.runner.sampler._compiled
    theirs = tiny_llm.engine.executor.runner.sampler._compiled
    assert ours.keys() == theirs.keys() and len(ours) > 1
    assert all(ours[key] is theirs[key] for key in ours)
