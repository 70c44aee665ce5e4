"""The built-in logits processor that enforces thinking budgets (`reasoning.budget`).

`ThinkingTokenBudgetProcessor` is a `jaxengine.logits_processor.LogitsProcessor`
installed by the worker whenever `budget.budget_support` finds a reasoning parser with
a single end token id (``--reasoning-parser``; nothing to pass to
``--logits-processors``). Its host side keeps a `budget.RowBudget` per batch index
whose request names a budget; its state is one int32 per row: the token the row must
take (the end token once the budget is spent), -1 for a free row. Its ``apply`` keeps
that token alone (logit 0, every other -inf) and leaves free rows untouched. It may
move the argmax, so it runs for greedy rows too, before the penalties.

Imports jax (``apply``); the package's ``__init__`` does not import this module.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxengine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from jaxengine.reasoning.budget import RowBudget, ThinkingMarkers, requested_budget


class ThinkingTokenBudgetProcessor(LogitsProcessor):
    """Forces the end of reasoning on rows whose thinking budget is spent."""

    def __init__(
        self,
        vllm_config: Any,
        device: Any,
        is_pin_memory: bool,
        markers: ThinkingMarkers | None = None,
    ) -> None:
        """``markers``: the reasoning parser's (`budget.budget_support`); the worker
        passes them, so this class is not one to name in ``--logits-processors``."""
        if markers is None:
            raise ValueError(
                "ThinkingTokenBudgetProcessor is built in: --reasoning-parser installs it "
                "with the parser's end token; it is not a --logits-processors class"
            )
        self.markers = markers
        self.rows: dict[int, RowBudget] = {}  # batch index -> its request's budget

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        requested_budget(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            budget = requested_budget(params)
            if budget is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = RowBudget(budget, self.markers, prompt_ids, output_ids)
        for src, dst, how in batch_update.moved:
            a, b = self.rows.pop(src, None), self.rows.pop(dst, None)
            if a is not None:
                self.rows[dst] = a
            if b is not None and how == MoveDirectionality.SWAP:
                self.rows[src] = b

    def state(self, num_rows: int) -> np.ndarray:
        forced = np.full(num_rows, -1, np.int32)  # [R]: the token each row must take
        for index, row in self.rows.items():
            if index < num_rows and row.must_end():
                forced[index] = self.markers.end_token_id
        return forced

    def apply(self, logits, state):
        forced = state[:, None]  # [R, 1]
        vocab = jnp.arange(logits.shape[-1], dtype=forced.dtype)[None, :]  # [1, V]
        only = jnp.where(vocab == forced, 0.0, -jnp.inf).astype(logits.dtype)  # [R, V]
        return jnp.where(forced >= 0, only, logits)
