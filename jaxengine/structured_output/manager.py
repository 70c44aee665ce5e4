"""StructuredOutputManager: the grammar state of every constrained request of one engine.

The scheduler drives it (the `GrammarTracker` protocol in `jaxengine.core.grammar`):

- `is_ready(request)` when a waiting request could be admitted: the first call
  submits its grammar's compile to a thread pool and returns False until it is done,
  so the engine loop never waits for a compile and the scheduler admits other requests
  meanwhile. Compiled grammars are cached by their grammar text (kind + spec); each
  request gets its own copy of the cached matcher.
- `bitmask(requests)` for the requests that sample in a step: one int32 row of
  `ceil(V / 32)` words each (bit set = token allowed), filled by the backend (in
  parallel for many rows). The runner applies the rows in the compiled sampler.
- `accept(request, token_ids)` after the step: the sampled tokens advance the matcher.
- `free(request_id)` when the request finishes or is aborted.

With a reasoning parser, a request's grammar starts only once the model has closed
its reasoning section (the output contains the end marker, or the prompt already
closed it); the tokens after the marker are its first input. Preemption keeps a
request's output tokens (recompute replays them as prompt, swapping keeps the pages),
so its matcher stays valid and is not rewound; `Grammar.rollback` exists for drafts
that a verifier rejects.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxengine.structured_output.backend import Grammar, GrammarBackend, bitmask_width

logger = logging.getLogger(__name__)

CACHE_SIZE = 512
"""Compiled grammars kept (least recently used dropped first)."""


@dataclass
class _State:
    """One request's grammar: compiling (future), then its own matcher."""

    future: Future
    grammar: Grammar | None = None
    active: bool = True
    """False while the model is still reasoning (the grammar waits for its end)."""
    failed: bool = False


class StructuredOutputManager:
    """Grammar compile, bitmask and accept for the requests of one engine."""

    def __init__(
        self,
        backend: GrammarBackend,
        vocab_size: int,
        *,
        reasoner: Any = None,
        enable_in_reasoning: bool = False,
        max_workers: int = 2,
    ) -> None:
        self.backend = backend
        self.width = bitmask_width(vocab_size)
        self.reasoner = reasoner
        self.enable_in_reasoning = enable_in_reasoning
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._states: dict[str, _State] = {}

    # ------------------------------------------------------------ before queueing

    def validate(self, params: Any) -> None:
        """Checks a request's constraint; ValueError naming the problem (-> HTTP 400)."""
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return
        key = self.backend.grammar_key(so)
        try:
            self.backend.validate(key)
        except ValueError as e:
            raise ValueError(f"invalid structured_outputs.{so.kind}: {e}") from None

    # ------------------------------------------------------------ scheduler side

    @staticmethod
    def wants(request: Any) -> bool:
        return getattr(request.sampling_params, "structured_outputs", None) is not None

    def is_ready(self, request: Any) -> bool:
        """Whether the request's grammar is compiled (starting the compile if needed).

        Raises ValueError if the compile failed; the request cannot run.
        """
        if not self.wants(request):
            return True
        state = self._states.get(request.request_id)
        if state is None:
            key = self.backend.grammar_key(request.sampling_params.structured_outputs)
            state = _State(self._compiled(key), active=self._starts_active(request))
            self._states[request.request_id] = state
        if state.grammar is None:
            if not state.future.done():
                return False
            state.grammar = state.future.result().copy()  # raises the compile error
        return True

    def _starts_active(self, request: Any) -> bool:
        """Constrained from the first token, unless the model is to reason first (a
        prompt that already closes the reasoning section, as Qwen3's template does
        with thinking disabled, does not count)."""
        if self.reasoner is None or self.enable_in_reasoning:
            return True
        return self.reasoner.is_reasoning_end(request.prompt_token_ids)

    def _compiled(self, key: str) -> Future:
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self.backend.compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def bitmask(
        self, requests: Sequence[Any], drafts: Mapping[str, Sequence[int]] | None = None
    ) -> tuple[tuple[str, ...], np.ndarray | None]:
        """(request ids, their rows [n, W] int32) for the constrained ones in `requests`;
        one more row per proposal in ``drafts`` (the mask after it)."""
        drafts = drafts or {}
        rows = []
        for request in requests:
            grammar = self._active(request)
            if grammar is not None:
                rows.append((request.request_id, grammar, drafts.get(request.request_id, ())))
        if not rows:
            return (), None
        bitmask = np.full((sum(1 + len(d) for *_, d in rows), self.width), -1, np.int32)
        plain, row = [], 0
        for _, grammar, ids in rows:
            if ids:
                self._fill_after_drafts(grammar, ids, bitmask, row)
            else:
                plain.append((grammar, row))
            row += 1 + len(ids)
        if plain:
            self.backend.fill_bitmasks(plain, bitmask)
        return tuple(rid for rid, *_ in rows), bitmask

    @staticmethod
    def _fill_after_drafts(grammar: Grammar, ids: Sequence[int], bitmask, row: int) -> None:
        """Rows ``row ...`` : the mask now and after each proposal (then rewound)."""
        grammar.fill_bitmask(bitmask, row)
        for j, token in enumerate(ids):
            grammar.accept_tokens([token])
            grammar.fill_bitmask(bitmask, row + 1 + j)
        grammar.rollback(len(ids))

    def check_drafts(self, request: Any, drafts: Sequence[int]) -> tuple[int, ...]:
        state = self._states.get(request.request_id)
        if state is None:
            return tuple(drafts)
        grammar = self._active(request)
        if grammar is None:  # compiling, failed, or waiting for the end of reasoning
            return ()
        return tuple(drafts[: grammar.validate_tokens(drafts)])

    def _active(self, request: Any) -> Grammar | None:
        state = self._states.get(request.request_id)
        if state is not None and state.grammar is not None and state.active:
            return state.grammar
        return None

    def accept(self, request: Any, token_ids: Sequence[int]) -> None:
        """Advances the request's grammar over its newly sampled tokens."""
        state = self._states.get(request.request_id)
        if state is None or state.grammar is None or not token_ids:
            return
        if not state.active:
            if not self.reasoner.is_reasoning_end(request.output_token_ids):
                return
            state.active = True
            token_ids = self.reasoner.content_token_ids(request.output_token_ids)
            if not token_ids:
                return
        if state.grammar.is_terminated():  # complete: only EOS was allowed, nothing to feed
            return
        if not state.grammar.accept_tokens(token_ids) and not state.failed:
            state.failed = True
            logger.warning(
                "request %s: sampled tokens %s do not fit its grammar (%s)",
                request.request_id,
                list(token_ids),
                getattr(state.grammar, "error", ""),
            )

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_manager(
    so_config: Any, tokenizer: Any, vocab_size: int, eos_token_id: int | None
) -> StructuredOutputManager | None:
    """The engine's manager for `StructuredOutputsConfig`; None without a tokenizer."""
    if tokenizer is None:
        return None
    backend_name = so_config.backend
    if backend_name != "guidance":
        raise NotImplementedError(
            f"--structured-outputs-config.backend {backend_name} is not supported yet"
        )
    from jaxengine.structured_output.guidance import GuidanceBackend

    backend = GuidanceBackend(
        tokenizer, vocab_size, eos_token_id, so_config.structured_outputs_config
    )
    reasoner = None
    if so_config.reasoning_parser_name:
        from jaxengine.reasoning import get_reasoning_parser, import_reasoning_parser_plugin

        if so_config.reasoning_parser_plugin:
            import_reasoning_parser_plugin(so_config.reasoning_parser_plugin)
        reasoner = get_reasoning_parser(so_config.reasoning_parser_name)(tokenizer)
    return StructuredOutputManager(
        backend,
        vocab_size,
        reasoner=reasoner,
        enable_in_reasoning=bool(so_config.option("enable_in_reasoning")),
    )
