"""Thinking budgets without a model (`jaxengine.reasoning.budget`): where a request's
reasoning starts and when its end token is due, which engines enforce a budget (and
the refusal naming it elsewhere), the built-in processor's state and ``apply``, and
the server's ``thinking_token_budget`` / ``vllm_xargs`` reaching ``extra_args``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pydantic
import pytest

from jaxengine.logits_processor import BatchUpdate
from jaxengine.reasoning.base import ReasoningParser, register_reasoning_parser
from jaxengine.reasoning.budget import (
    BudgetSupport,
    RowBudget,
    ThinkingMarkers,
    budget_support,
    requested_budget,
)
from jaxengine.reasoning.budget_processor import ThinkingTokenBudgetProcessor
from jaxengine.sampling_params import SamplingParams
from server.chat.protocol import ChatCompletionRequest
from server.completions.protocol import CompletionRequest

START, END = 1, 2
OPEN = ThinkingMarkers(END, START)  # qwen3-like: the model opens the block
IMPLICIT = ThinkingMarkers(END, START, implicit=True)  # deepseek_r1-like


def params(budget=None, **extra) -> SamplingParams:
    if budget is not None:
        extra["thinking_token_budget"] = budget
    return SamplingParams(extra_args=extra or None)


def due(budget, markers, prompt, output) -> list[bool]:
    """``must_end()`` after each prefix of ``output`` (one live list, grown in place)."""
    live: list[int] = []
    row = RowBudget(budget, markers, prompt, live)
    got = [row.must_end()]
    for token in output:
        live.append(token)
        got.append(row.must_end())
    return got


# ---------------------------------------------------------------------- the count


def test_a_prompt_that_opens_the_block_counts_from_the_first_token():
    assert due(3, OPEN, [7, START], [5, 6, 7]) == [False, False, False, True]
    assert due(0, OPEN, [7, START], []) == [True]
    # the end token closes it for good: nothing is forced after it
    assert due(1, OPEN, [START], [5, END, 6, 7]) == [False, True, False, False, False]


def test_the_model_opening_the_block_starts_the_count_after_its_start_token():
    assert due(2, OPEN, [7], [9, START, 5, 6]) == [False, False, False, False, True]
    assert due(0, OPEN, [7], [START]) == [False, True]
    assert due(2, OPEN, [7], [9, 9, 9]) == [False] * 4  # never reasoning: nothing due


def test_a_closed_block_in_the_prompt_and_implicit_parsers():
    assert due(0, OPEN, [START, 4, END], [5]) == [False, False]  # thinking disabled
    assert due(1, IMPLICIT, [7], [5, 6]) == [False, True, True]  # no marker: reasoning
    assert due(1, IMPLICIT, [START, 4, END], [5, 6]) == [False, False, False]


def test_a_replaced_output_list_is_counted_again():
    live = [5, 6]
    row = RowBudget(2, OPEN, [START], live)
    assert row.must_end()
    live[:] = [5]  # a shorter list (a recomputed request): counted from the start
    assert not row.must_end() and row.count == 1


@pytest.mark.parametrize("bad", [-1, "8", 1.5, True])
def test_a_bad_budget_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="thinking_token_budget.*budget_tokens.*non-negative"):
        requested_budget(params(bad))
    assert requested_budget(params()) is None and requested_budget(params(0)) == 0


# ---------------------------------------------------------------------- which engines


@register_reasoning_parser("test_no_end_token")
class NoEndToken(ReasoningParser):
    """A parser whose end of reasoning is no single token."""


def config(parser="", speculative=False, plugin=""):
    so = SimpleNamespace(reasoning_parser_name=parser, reasoning_parser_plugin=plugin)
    spec = SimpleNamespace(enabled=speculative)
    return SimpleNamespace(structured_outputs_config=so, speculative_config=spec)


THINK_VOCAB = SimpleNamespace(get_vocab=lambda: {"<think>": 5, "</think>": 6})


def test_budget_support_follows_the_reasoning_parser():
    assert budget_support(config("qwen3"), THINK_VOCAB).markers == ThinkingMarkers(6, 5, False)
    deepseek = budget_support(config("deepseek_r1"), THINK_VOCAB).markers
    assert deepseek == ThinkingMarkers(6, 5, True)
    cases = [
        (config(), THINK_VOCAB, False, "--reasoning-parser"),
        (config("qwen3", speculative=True), THINK_VOCAB, False, "speculative decoding"),
        (config("qwen3"), None, False, "--skip-tokenizer-init"),
        (config("qwen3"), THINK_VOCAB, True, "pooling model"),
        (config("test_no_end_token"), THINK_VOCAB, False, "no single end-of-reasoning token"),
    ]
    for cfg, tokenizer, pooling, why in cases:
        support = budget_support(cfg, tokenizer, pooling)
        assert support.markers is None and why in support.why_not
        assert support.check(params()) is None  # a request without a budget is fine
        with pytest.raises(ValueError, match=f"budget_tokens\\) cannot be enforced: .*{why}"):
            support.check(params(4096))


def test_a_supported_budget_is_checked_and_returned():
    support = BudgetSupport(OPEN)
    assert support.check(params(16)) == 16 and support.check(params()) is None
    with pytest.raises(ValueError, match="non-negative"):
        support.check(params(-2))


# ---------------------------------------------------------------------- the processor


def test_the_processor_forces_the_end_token_on_spent_rows_only():
    import jax.numpy as jnp

    proc = ThinkingTokenBudgetProcessor(None, None, False, OPEN)
    spent, fresh, free = [5, 6], [5], [5, 6, 7]
    added = [
        (0, params(2), [START], spent),
        (1, params(2), [START], fresh),
        (2, params(), [START], free),
    ]
    proc.update_state(BatchUpdate(3, [], added, []))
    assert list(proc.state(4)) == [END, -1, -1, -1]  # padded rows stay free
    fresh.append(9)  # the live list grows: row 1 has spent its budget too
    proc.update_state(None)
    assert list(proc.state(4)) == [END, END, -1, -1]
    proc.update_state(BatchUpdate(3, [0], [], []))
    state = proc.state(3)
    assert list(state) == [-1, END, -1]
    logits = jnp.asarray(np.arange(24, dtype=np.float32).reshape(3, 8))
    out = np.asarray(proc.apply(logits, jnp.asarray(state)))
    assert np.array_equal(out[[0, 2]], np.asarray(logits)[[0, 2]])  # free rows unchanged
    assert out[1, END] == 0 and np.isneginf(np.delete(out[1], END)).all()


def test_the_processor_is_built_in_not_named():
    with pytest.raises(ValueError, match="built in: --reasoning-parser installs it"):
        ThinkingTokenBudgetProcessor(None, None, False)


# ---------------------------------------------------------------------- the server


def test_the_server_field_and_vllm_xargs_reach_extra_args():
    both = CompletionRequest(prompt="Hi", thinking_token_budget=8, vllm_xargs={"x": 1})
    extra = both.sampling_params(4, None, {}).extra_args
    assert extra == {"x": 1, "thinking_token_budget": 8}
    messages = [{"role": "user", "content": "Hi"}]
    xargs = ChatCompletionRequest(messages=messages, vllm_xargs={"thinking_token_budget": 3})
    assert xargs.sampling_params(4, None, {}).extra_args == {"thinking_token_budget": 3}
    with pytest.raises(pydantic.ValidationError, match="thinking_token_budget"):
        ChatCompletionRequest(messages=messages, thinking_token_budget=-1)
