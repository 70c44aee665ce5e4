"""Thinking budgets on an offline engine (`jaxengine.reasoning.budget`).

The tiny model (SmolLM2's tokenizer, random weights) has no think markers, so this
module registers a reasoning parser, ``tiny_think``, whose markers are two of SmolLM2's
special tokens; ``--reasoning-parser tiny_think`` installs the built-in processor with
no ``--logits-processors``. A prompt that ends with the start marker opens the block
in the prompt: a request with ``thinking_token_budget`` N then generates what it would
without one for N tokens, the end marker at N exactly, and freely after it. Rows without
a budget (greedy and random), batched with budget rows, are token-identical to the
same engine's unbudgeted run; nothing compiles after warm-up; a bad budget, or one on
an engine without a reasoning parser, is refused before it is queued.
"""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.reasoning import register_reasoning_parser
from jaxengine.reasoning.base import vocab_token_id
from jaxengine.reasoning.think import Qwen3ReasoningParser
from tests.engine.conftest import small_llm_kwargs

START_MARK, END_MARK = "<issue_start>", "<issue_closed>"


@register_reasoning_parser("tiny_think")
class TinyThinkParser(Qwen3ReasoningParser):
    """qwen3's rules on two SmolLM2 special tokens (the token side only)."""

    name = "tiny_think"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.start_token_id = vocab_token_id(tokenizer, START_MARK)
        self.end_token_id = vocab_token_id(tokenizer, END_MARK)


@pytest.fixture(scope="module")
def llm(tiny_smollm2, xla_cache_dir):
    engine = LLM(
        model=str(tiny_smollm2[0]),
        reasoning_parser="tiny_think",
        reasoning_parser_plugin=__name__,  # each engine process imports this module
        **small_llm_kwargs(xla_cache_dir),
    )
    yield engine
    engine.engine.shutdown()


def _markers(llm) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    return vocab_token_id(tokenizer, START_MARK), vocab_token_id(tokenizer, END_MARK)


def _params(budget=None, temperature=0.0, max_tokens=10) -> SamplingParams:
    extra = None if budget is None else {"thinking_token_budget": budget}
    return SamplingParams(
        temperature=temperature, seed=5, max_tokens=max_tokens, ignore_eos=True, extra_args=extra
    )


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prompts(start: int) -> list[dict]:
    opened = [504, 3575, 282, 4649, 314, start]  # the prompt opens the block
    return [
        {"prompt_token_ids": opened},
        {"prompt_token_ids": [17, 29, 301, 44, start]},
        {"prompt_token_ids": [29, 27, 25, 23, 21]},
        {"prompt_token_ids": [100 + 3 * i for i in range(40)] + [start]},
    ]


@pytest.mark.slow
def test_the_end_token_comes_after_the_budget_and_other_rows_are_untouched(llm):
    guard = llm.engine.executor.runner.guard
    assert guard.armed
    before = guard.compiles_after_warmup
    start, end = _markers(llm)
    prompts = _prompts(start)
    free = [_params(), _params(), _params(temperature=0.8), _params(temperature=0.8)]
    want = _ids(llm.generate(prompts, free, use_tqdm=False))
    assert not any(end in ids for ids in want)  # the model never ends by itself here
    budgets = [_params(3), _params(), _params(temperature=0.8), _params(0, temperature=0.8)]
    got = _ids(llm.generate(prompts, budgets, use_tqdm=False))
    assert got[0][:3] == want[0][:3] and got[0][3] == end
    assert got[3][0] == end  # a zero budget: the block closes at once (random row too)
    assert got[1] == want[1] and got[2] == want[2]  # no budget: token-identical
    # after the end token the processor does nothing: the row goes on as a plain
    # request on the same tokens would
    (after,) = _ids(
        llm.generate(
            [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + got[0][:4]}],
            _params(max_tokens=6),
            use_tqdm=False,
        )
    )
    assert got[0][4:] == after and end not in got[0][4:]
    assert guard.compiles_after_warmup == before


@pytest.mark.slow
def test_a_budget_in_a_prompt_without_reasoning_changes_nothing(llm):
    start, end = _markers(llm)
    closed = {"prompt_token_ids": [504, 3575, start, 282, end, 314]}  # thinking disabled
    plain = {"prompt_token_ids": [29, 27, 25, 23, 21]}  # no marker, qwen3 rules: no reasoning
    want = _ids(llm.generate([closed, plain], [_params(), _params()], use_tqdm=False))
    got = _ids(llm.generate([closed, plain], [_params(0), _params(0)], use_tqdm=False))
    assert got == want


@pytest.mark.slow
def test_bad_budgets_are_refused_before_they_are_queued(llm, tiny_llm):
    with pytest.raises(ValueError, match="thinking_token_budget.*non-negative integer"):
        llm.generate([{"prompt_token_ids": [1, 2]}], _params(-1), use_tqdm=False)
    with pytest.raises(ValueError, match="budget_tokens\\) cannot be enforced.*--reasoning-parser"):
        tiny_llm.generate([{"prompt_token_ids": [1, 2]}], _params(8), use_tqdm=False)
    for engine in (llm, tiny_llm):
        stats = engine.engine.get_stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
