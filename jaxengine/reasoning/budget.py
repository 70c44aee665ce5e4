"""Thinking budgets, host side: how many tokens a request may reason before it must end.

A request asks for a budget with ``extra_args={"thinking_token_budget": N}`` (vLLM's
name for it; the server's top-level ``thinking_token_budget`` and ``vllm_xargs`` both
land there, and Anthropic's ``thinking.budget_tokens`` is translated to it). Once the
request has generated N tokens inside its reasoning section without closing it, the
built-in `budget_processor.ThinkingTokenBudgetProcessor` forces the reasoning parser's
end token; after the end token it does nothing.

Where the reasoning section starts (`RowBudget`):

* at the output's first token when the prompt opened it: the last think marker of the
  prompt is the start token (templates that open ``<think>`` in the prompt), or the
  prompt has no marker and the parser is implicit (``deepseek_r1``: an output without
  markers is reasoning);
* otherwise after the first start token the model writes (``qwen3``); a prompt whose
  last marker is the end token (thinking disabled by the template) has no reasoning.

The start token is not counted; N = 0 forces the end token at once. The budget is
enforced only where `budget_support` finds a reasoning parser with one end token id
(and no speculative decoding, a generating model, a tokenizer); anywhere else a request
that names a budget is refused (`BudgetSupport.check`, a 400 from the server).

Pure Python: no jax (the processor's `apply` lives in `budget_processor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxengine.config import EngineConfig

THINKING_TOKEN_BUDGET = "thinking_token_budget"
"""The ``extra_args`` key of a request's budget (vLLM's request field name)."""
NAMES = f"{THINKING_TOKEN_BUDGET} (Anthropic's thinking.budget_tokens)"


def requested_budget(params: Any) -> int | None:
    """The budget ``params.extra_args`` names, or None; ValueError for one that is not
    a non-negative integer."""
    extra = getattr(params, "extra_args", None) or {}
    budget = extra.get(THINKING_TOKEN_BUDGET)
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{NAMES} must be a non-negative integer, got {budget!r}")
    return budget


@dataclass(frozen=True)
class ThinkingMarkers:
    """The reasoning parser's markers, as token ids."""

    end_token_id: int
    start_token_id: int | None = None
    implicit: bool = False
    """An output is reasoning until the end token when the prompt has no marker."""


@dataclass(frozen=True)
class BudgetSupport:
    """Whether this engine enforces thinking budgets: ``markers``, or why not."""

    markers: ThinkingMarkers | None
    why_not: str = ""

    def check(self, params: Any) -> int | None:
        """The request's budget (None: none asked); ValueError when it is malformed or
        this engine cannot enforce it."""
        budget = requested_budget(params)
        if budget is not None and self.markers is None:
            raise ValueError(f"{NAMES} cannot be enforced: {self.why_not}")
        return budget


def budget_support(config: EngineConfig, tokenizer: Any, pooling: bool = False) -> BudgetSupport:
    """What `BudgetSupport` an engine of ``config`` has (the engine and each worker
    decide alike, so a budget is accepted exactly where the processor runs)."""
    so = config.structured_outputs_config
    name = so.reasoning_parser_name
    why = ""
    if pooling:
        why = "a pooling model generates nothing"
    elif not name:
        why = "it needs a reasoning parser (start the server with --reasoning-parser)"
    elif config.speculative_config.enabled:
        why = "not supported with speculative decoding (--speculative-config)"
    elif tokenizer is None:
        why = "it needs a tokenizer (--skip-tokenizer-init is set)"
    if why:
        return BudgetSupport(None, why)
    parser = _reasoning_parser(name, so.reasoning_parser_plugin, tokenizer)
    markers = parser_markers(parser)
    if markers is None:
        why = f"--reasoning-parser {name} has no single end-of-reasoning token id to force"
    return BudgetSupport(markers, why)


def parser_markers(parser: Any) -> ThinkingMarkers | None:
    """The markers of a parser with an integer ``end_token_id`` (``start_token_id``
    and ``implicit`` optional), else None."""
    end = getattr(parser, "end_token_id", None)
    if isinstance(end, bool) or not isinstance(end, int):
        return None
    start = getattr(parser, "start_token_id", None)
    start = start if isinstance(start, int) and not isinstance(start, bool) else None
    return ThinkingMarkers(end, start, bool(getattr(parser, "implicit", False)))


def _reasoning_parser(name: str, plugin: str, tokenizer: Any) -> Any:
    from jaxengine.reasoning import get_reasoning_parser, import_reasoning_parser_plugin

    if plugin:
        import_reasoning_parser_plugin(plugin)
    return get_reasoning_parser(name)(tokenizer)


class RowBudget:
    """One request's reasoning count, advanced over its live output list.

    ``must_end()`` scans the tokens generated since its last call (so each token is
    looked at once) and says whether the next token must be the end token."""

    def __init__(
        self,
        budget: int,
        markers: ThinkingMarkers,
        prompt_token_ids: Sequence[int] | None,
        output_token_ids: Sequence[int],
    ) -> None:
        self.budget = budget
        self.markers = markers
        self.output = output_token_ids  # live: extended in place as tokens come
        self._opened = _prompt_opens(markers, prompt_token_ids or ())
        self._restart()

    def _restart(self) -> None:
        self.reasoning = self._opened
        self.ended = False
        self.count = 0  # tokens generated inside the reasoning section
        self._seen = 0  # output tokens scanned

    def must_end(self) -> bool:
        if len(self.output) < self._seen:  # the list was replaced by a shorter one
            self._restart()
        end, start = self.markers.end_token_id, self.markers.start_token_id
        while self._seen < len(self.output) and not self.ended:
            token = self.output[self._seen]
            self._seen += 1
            if token == end:
                self.ended = True
            elif token == start and not self.reasoning:
                self.reasoning = True
            elif self.reasoning:
                self.count += 1
        return self.reasoning and not self.ended and self.count >= self.budget


def _prompt_opens(markers: ThinkingMarkers, prompt: Sequence[int]) -> bool:
    """Whether the output starts inside the reasoning section (see the module doc)."""
    for token in reversed(prompt):
        if token == markers.end_token_id:
            return False
        if token == markers.start_token_id:
            return True
    return markers.implicit
