"""The runner's host-side batch state, kept across steps.

`RequestTable` holds what the runner knows of each request (its tokens so far, how
many have been computed, its sampling parameters and seed) and one persistent block
table: a numpy array with a row per request, updated by each `SchedulerOutput`
(new requests fill a row, running ones append their new pages in place, a resumed
one overwrites its row), never rebuilt from Python lists. Packing a step reads the
rows as views. Numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxengine.core.sched_output import SchedulerOutput
from jaxengine.runner.batch import NULL_PAGE, SeqChunk
from jaxengine.runner.sampling_metadata import request_seed
from jaxengine.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestState:
    """What the runner keeps of a request between steps."""

    token_ids: list[int]  # prompt + outputs so far
    num_prompt: int
    params: SamplingParams
    seed: int
    row: int  # its row of the block table
    num_pages: int = 0
    num_computed: int = 0
    lora_request: Any = None  # its `LoRARequest`, None for the base model
    images: tuple = ()  # its images' ``(key, prompt positions)`` (`runner.encoder`)
    image_grids: tuple = ()  # an M-RoPE model's: its images' token grids (`runner.encoder`)
    state_slot: int = -1  # a hybrid model's: its slot in the state pools (`runner.states`)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


class RequestTable:
    """Requests by id, and their pages in one ``[rows, pages_per_req]`` int32 table."""

    def __init__(
        self, pages_per_req: int, base_seed: int, rows: int = 64, state_slots: int = 0
    ) -> None:
        """``state_slots``: a hybrid model's state-pool slots (`runner.states`), one per
        running request: taken when a request is scheduled from no computed tokens,
        given back when it finishes or is preempted (a recompute re-prefills it from
        a zero state; the model zeroes a request whose context is empty)."""
        self.pages_per_req = pages_per_req
        self.base_seed = base_seed
        self.block_table = np.full((rows, pages_per_req), NULL_PAGE, np.int32)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        self._counter = 0
        self._state_slots = state_slots
        self._free_slots = list(range(state_slots - 1, -1, -1))

    def __getitem__(self, req_id: str) -> RequestState:
        return self.requests[req_id]

    def apply(self, out: SchedulerOutput) -> None:
        """Forgets finished requests, registers new ones, updates the running ones."""
        for req_id in out.finished_req_ids:
            self._remove(req_id)
        for req_id in out.preempted_req_ids:
            if req_id in self.requests:
                self._free_slot(self.requests[req_id])
        for new in out.scheduled_new_reqs:
            seed = request_seed(new.sampling_params, self.base_seed, self._counter)
            self._counter += 1
            state = RequestState(
                token_ids=list(new.prompt_token_ids),
                num_prompt=len(new.prompt_token_ids),
                params=new.sampling_params,
                seed=seed,
                row=self._take_row(),
                num_computed=new.num_computed_tokens,
                lora_request=new.lora_request,
                images=new.images,
                image_grids=new.image_grids,
            )
            self._set_pages(state, new.block_ids, append=False)
            self.requests[new.req_id] = state
            self._take_slot(state)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            self._set_pages(state, cached.new_block_ids, append=not cached.resumed_from_preemption)
            state.num_computed = cached.num_computed_tokens
            self._take_slot(state)
            num_drafts = len(out.scheduled_spec_decode_tokens.get(cached.req_id, ()))
            known = cached.new_token_ids[: len(cached.new_token_ids) - num_drafts]
            if cached.num_computed_tokens + len(known) > len(state.token_ids):  # (defensive)
                state.token_ids[cached.num_computed_tokens :] = known

    def chunk(self, state: RequestState, num_tokens: int) -> SeqChunk:
        """The request's share of a step: its next ``num_tokens`` tokens and its pages
        (a view of its block-table row)."""
        start = state.num_computed
        return SeqChunk(
            state.token_ids[start : start + num_tokens],
            start,
            self.block_table[state.row, : state.num_pages],
            state_row=state.state_slot,
        )

    def clear(self) -> None:
        for req_id in list(self.requests):
            self._remove(req_id)

    # ------------------------------------------------------------------ rows

    def _set_pages(self, state: RequestState, page_ids: tuple[int, ...], append: bool) -> None:
        start = state.num_pages if append else 0
        end = start + len(page_ids)
        if end > self.pages_per_req:
            raise ValueError(
                f"{end} pages for one request exceed the {self.pages_per_req} that "
                "max_model_len needs"
            )
        row = self.block_table[state.row]
        row[start:end] = page_ids
        if not append:
            row[end:] = NULL_PAGE
        state.num_pages = end

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.block_table.shape[0]
            grown = np.full((2 * rows, self.pages_per_req), NULL_PAGE, np.int32)
            grown[:rows] = self.block_table
            self.block_table = grown
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table[state.row] = NULL_PAGE
            self._free_rows.append(state.row)
            self._free_slot(state)

    def _take_slot(self, state: RequestState) -> None:
        """A state slot for a request that runs without one (hybrid models only)."""
        if not self._state_slots or state.state_slot >= 0:
            return
        if not self._free_slots:
            raise RuntimeError("more running requests than state slots (max_num_seqs)")
        state.state_slot = self._free_slots.pop()

    def _free_slot(self, state: RequestState) -> None:
        if state.state_slot >= 0:
            self._free_slots.append(state.state_slot)
            state.state_slot = -1
