"""Custom logits processors (``--logits-processors``) in the compiled sampler.

The sampler alone: a processor that is not argmax invariant changes greedy and random
rows; an argmax-invariant one is skipped by greedy rows (and by all-greedy variants)
and applied to random rows after temperature, as vLLM orders them. Then an offline
`LLM` on the tiny model with the example processors (tests/example_logits_processors.py:
one named by qualified name, one given as a class): a request with
``extra_args={"target_token": t}`` generates only ``t``, every other row generates
exactly what the shared `tiny_llm` (the same engine without processors) does for the
same batch, nothing compiles after warm-up, and ``validate_params`` refuses a bad
request before it is queued. A class of vLLM's torch form is refused at start-up.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxengine import LLM, EngineArgs, SamplingParams
from jaxengine.entrypoints.factory import engine_config
from jaxengine.runner.logits_processors import ProcessorBatch
from jaxengine.runner.sampler import sample
from jaxengine.runner.sampling_metadata import SamplerFlags, SamplingBatch, SamplingRow
from tests.engine.conftest import small_llm_kwargs
from tests.example_logits_processors import InvariantTargetProcessor, TargetTokenProcessor

V = 16
TARGET = f"{TargetTokenProcessor.__module__}:TargetTokenProcessor"


# ---------------------------------------------------------------------- the sampler


def _sample(rows, flags, processors, logits):
    batch = ProcessorBatch([cls(None, None, False) for cls in processors])
    states = batch.step([str(i) for i in range(len(rows))], rows, len(rows))
    md = SamplingBatch(rows, len(rows), V).to_metadata(flags)._replace(processor_states=states)
    run = jax.jit(functools.partial(sample, flags=flags, processors=batch.processors))
    return np.asarray(run(logits, md).token_ids)


def _row(temperature=0.0, **extra):
    return SamplingRow(SamplingParams(temperature=temperature, extra_args=extra), [], [1], 3)


def test_processors_run_where_vllm_runs_them():
    logits = np.random.default_rng(0).normal(size=(3, V)).astype(np.float32)
    greedy = np.argmax(logits, axis=-1)
    target = [_row(target_token=5), _row(), _row(1.0, target_token=7)]
    mixed = SamplerFlags(filter_width=V, num_logprobs=0)
    assert list(_sample(target, mixed, [TargetTokenProcessor], logits)) == [5, greedy[1], 7]
    # argmax invariant: skipped by greedy rows, applied to random ones
    rows = [_row(invariant_target=5), _row(), _row(1.0, invariant_target=7)]
    got = _sample(rows, mixed, [InvariantTargetProcessor], logits)
    assert list(got) == [greedy[0], greedy[1], 7]
    rows = [_row(invariant_target=5), _row()]
    got = _sample(rows, SamplerFlags(all_greedy=True), [InvariantTargetProcessor], logits[:2])
    assert list(got) == list(greedy[:2])


# ---------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llm(tiny_smollm2, xla_cache_dir):
    engine = LLM(
        model=str(tiny_smollm2[0]),
        logits_processors=[TARGET, InvariantTargetProcessor],
        **small_llm_kwargs(xla_cache_dir),
    )
    yield engine
    engine.engine.shutdown()


PROMPTS = [
    {"prompt_token_ids": [504, 3575, 282, 4649, 314]},
    {"prompt_token_ids": [100 + 3 * i for i in range(40)]},  # longer than the budget
    {"prompt_token_ids": [17, 29, 301]},
    {"prompt_token_ids": [9, 8, 7, 6, 5, 4]},
]


def _params(temperature=0.0, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=11, max_tokens=6, ignore_eos=True, extra_args=extra or None
    )


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow
def test_target_token_rows_change_and_the_others_do_not(llm, tiny_llm):
    guard = llm.engine.executor.runner.guard
    assert guard.armed
    before = guard.compiles_after_warmup
    plain = [_params(), _params(), _params(0.8), _params(0.8)]
    params = [_params(), _params(target_token=42), _params(0.8), _params(0.8, target_token=7)]
    got = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
    want = _ids(tiny_llm.generate(PROMPTS, plain, use_tqdm=False))
    assert got[1] == [42] * 6 and got[3] == [7] * 6
    assert got[0] == want[0] and got[2] == want[2]
    # argmax invariant: greedy rows (and all-greedy batches) skip it, random rows not
    params = [_params(invariant_target=42), _params(), _params(0.8, invariant_target=9), plain[3]]
    got = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert got[0] == want[0] and got[1] == want[1] and got[2] == [9] * 6
    greedy = [_params(invariant_target=42), _params()]
    assert _ids(llm.generate(PROMPTS[:2], greedy, use_tqdm=False)) == want[:2]
    assert guard.compiles_after_warmup == before


@pytest.mark.slow
def test_validate_params_refuses_a_request_before_it_is_queued(llm):
    with pytest.raises(ValueError, match="target_token must be a non-negative integer"):
        llm.generate(PROMPTS[:1], _params(target_token="x"), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_a_torch_style_class_is_refused_at_start_up(tiny_smollm2):
    args = EngineArgs(
        model=str(tiny_smollm2[0]),
        logits_processors=["tests.example_logits_processors:TorchStyleProcessor"],
    )
    with pytest.raises(ValueError, match="TorchStyleProcessor is not a JAX logits processor"):
        engine_config(args)
