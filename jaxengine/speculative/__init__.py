"""Speculative decoding: proposers draft tokens, the target verifies them in its next step.

This package is the feature's one home:

- here (host side, no jax): what a proposer is given (`ProposalInput`, one per
  request of the step; `StepFeatures`) and the `Proposer` protocol, the runner's one
  seam into the feature (`ModelRunner` calls ``propose`` after each step);
- `speculative.verify`: the acceptance rule the runner applies to a step's sampled
  rows;
- `speculative.ngram`: proposals from the request's own tokens (numpy, on the host);
- `speculative.device`: the proposers that run a model on the device (a draft
  model: `device.draft`; a head on the step's hidden states, an EAGLE head or the
  checkpoint's multi-token-prediction layer: `device.eagle`), their loading and the
  builder the worker calls (`device.build`).

The runner imports this folder only; `speculative.device` imports the runner, never
the other way. The config is `config/speculative.py`, the heads' models
`models/eagle.py` and `models/mtp.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ProposalInput:
    """One request of a step, after its tokens are sampled and verified."""

    req_id: str
    token_ids: Sequence[int]
    """Its known tokens: prompt and outputs so far."""
    num_computed: int
    """Positions whose KV the target holds (its accepted tokens)."""
    pages: Sequence[int]
    """Its pages (block-table row), lookahead slots included."""
    propose: bool
    """False: mid-prefill, or sampling that takes no proposals (a grammar): only keep
    up with its tokens."""
    start: int = 0
    """The first position the step computed for it."""
    row: int = 0
    """That position's row in the step's hidden states (`StepFeatures.hidden`)."""


@dataclass(frozen=True)
class StepFeatures:
    """What the target step leaves on the device for a proposer that reads it."""

    hidden: Any
    """``[T, H]``: the target's last hidden states (after its final norm), one row per
    token of the step's batch."""
    params: Any
    """The target's parameters now (their LM head and embedding)."""


class Proposer(Protocol):
    """Drafts tokens for the requests of a step, after its tokens are sampled."""

    def propose(
        self,
        inputs: Sequence[ProposalInput],
        features: StepFeatures | None,
        ensure: Callable[[tuple], None],
    ) -> list[list[int]]:
        """One proposal (possibly empty) per input, none where ``propose`` is False.
        ``features``: the step's (None where it ran in several micro-batches).
        ``ensure(key)``: waits for (or runs) the warm-up job ``key`` of
        `compile_jobs` before its executable is used (background compilation)."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drops what it keeps of these requests (finished, or preempted)."""
        ...

    def compile_jobs(self) -> list[tuple[tuple, Callable[[], None]]]:
        """(key, job) of what it compiles at warm-up."""
        ...

    def release(self) -> None:
        """Deletes its device buffers, if any."""
        ...
