"""A launched step and how it reads itself back (`PendingStep.result()`).

`ModelRunner.launch` dispatches a step's micro-batches (`Launched`) and returns a
`PendingStep` without waiting. Its ``result()`` reads every micro-batch's sampled ids
and logprobs back, keeps each request's verified proposals
(`speculative.verify.accept`), appends the tokens to the request states, and asks
the runner (its `StepOwner`) for what needs the device state: prompt logprobs, a
pooling model's pooled rows, the next step's proposals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.runner.batch import SeqChunk
from jaxengine.runner.buckets import Bucket
from jaxengine.runner.compile_guard import CompileGuard
from jaxengine.runner.logprobs import row_logprobs
from jaxengine.runner.request_table import RequestState
from jaxengine.speculative.verify import accept


@dataclasses.dataclass(frozen=True)
class Feed:
    """The sampled ids of the latest launched step, while not yet collected: their
    device array (``[max_num_seqs]``) and each sampling request's row in it."""

    ids: Any
    rows: dict[str, int]


@dataclasses.dataclass
class Launched:
    """One dispatched micro-batch: its requests (by index), bucket, hidden states,
    sampled (token ids, logprobs) on device, and each request's first logits row."""

    group: list[int]
    bucket: Bucket
    hidden: Any
    result: Any
    rows: list[int]


class StepOwner(Protocol):
    """What a `PendingStep` asks of the runner that launched it."""

    guard: CompileGuard

    def collected(self, feed: Feed | None) -> None:
        """The step whose sampled ids are ``feed`` is read back: nothing feeds on them."""

    def pooled(self, step: PendingStep) -> RunnerOutput: ...

    def prompt_logprobs(
        self, part: Launched, states: list[RequestState], chunks: list[SeqChunk]
    ) -> list | None: ...

    def propose(self, step: PendingStep) -> list[list[int]] | None: ...


class PendingStep:
    """A launched step (`ModelRunner.launch`); `result()` reads it back once."""

    def __init__(
        self,
        owner: StepOwner,
        out: SchedulerOutput,
        order: list[str],
        states: list[RequestState],
        chunks: list[SeqChunk],
        launched: list[Launched],
        sampling: list,
        feed: Feed | None,
        pooling: bool = False,
    ) -> None:
        self.owner, self.out, self.order, self.states = owner, out, order, states
        self.chunks, self.launched, self.sampling, self.feed = chunks, launched, sampling, feed
        self.pooling = pooling  # a pooling model's step: pooled rows, nothing sampled
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        """The step's `RunnerOutput` (waits for the device the first time)."""
        if self._result is None:
            with self.owner.guard.watching():
                self._result = self._collect()
        return self._result

    def _collect(self) -> RunnerOutput:
        """Reads every micro-batch's results back and appends the sampled tokens to
        the request states."""
        self.owner.collected(self.feed)  # its tokens are known on the host from here on
        if not self.order:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        if self.pooling:
            return self.owner.pooled(self)
        rows, prompt_lps = self._read_back()
        sampled, logprobs = [], []
        for i, state in enumerate(self.states):
            if self.sampling[i] is None:
                sampled.append([])
                logprobs.append(None)
                continue
            tokens, lps = accepted(state, self.chunks[i], *rows[i])
            sampled.append(tokens)
            logprobs.append(lps)
        return RunnerOutput(
            req_ids=self.order,
            sampled_token_ids=sampled,
            logprobs=logprobs if any(x is not None for x in logprobs) else None,
            prompt_logprobs=prompt_lps if any(x is not None for x in prompt_lps) else None,
            spec_token_ids=self.owner.propose(self),
        )

    def _read_back(self) -> tuple[list, list]:
        """Per request: (token ids, logprobs, its first row) and its prompt logprobs."""
        rows: list[tuple[Any, Any, int]] = [None] * len(self.order)
        prompt_lps: list = [None] * len(self.order)
        for part in self.launched:
            token_ids, lp = jax.device_get(part.result)
            states = [self.states[i] for i in part.group]
            group_lps = self.owner.prompt_logprobs(
                part, states, [self.chunks[i] for i in part.group]
            )
            for j, (row, i) in enumerate(zip(part.rows, part.group, strict=True)):
                rows[i] = (token_ids, lp, row)
                prompt_lps[i] = group_lps[j] if group_lps else None
        return rows, prompt_lps


def accepted(state: RequestState, chunk: SeqChunk, token_ids, lp, row: int):
    """The tokens a request gets from its logits rows ``row, row + 1, ...``: the
    proposals it verified (the last ``num_logits - 1`` ids of its chunk) as
    `speculative.verify.accept` keeps them; and their logprobs (an entry, or a list of
    them with proposals). Updates ``state``: the tokens are appended, the rejected
    proposals' positions are no longer computed."""
    drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_logits + 1 :]
    tokens = accept(drafts, lambda j: int(token_ids[row + j]))
    state.token_ids.extend(tokens)
    state.num_computed -= len(drafts) + 1 - len(tokens)
    entries = [row_logprobs(lp, row + j, state.params) for j in range(len(tokens))]
    return tokens, (entries if drafts else entries[0])
