"""One `schedule()` call's decisions (`StepPlan`) and the `SchedulerOutput` made of
them (`step_output`): new requests are sent whole, running ones as diffs, and each
request's computed count and output placeholders advance past what was scheduled."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxengine.core.grammar import GrammarTracker
from jaxengine.core.request import Request
from jaxengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput


class Verdict(enum.Enum):
    ADMIT = 0
    SKIP = 1  # leave it queued, try the next waiting request
    STOP = 2  # stop admitting this step
    GONE = 3  # the request was finished (its grammar failed); go on with the next


@dataclass
class StepPlan:
    """Decisions of one `schedule()` call, turned into a SchedulerOutput at the end."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    first_time: set[str] = field(default_factory=set)
    resumed: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    spec: dict[str, tuple[int, ...]] = field(default_factory=dict)
    state_restores: list[tuple[str, int]] = field(default_factory=list)
    state_saves: list[tuple[str, int]] = field(default_factory=list)

    def add(
        self,
        req: Request,
        n: int,
        block_ids: list[int],
        state_save: int | None = None,
        state_restore: int | None = None,
    ) -> None:
        """``req`` computes ``n`` tokens in ``block_ids``; a hybrid model's saved-state
        rows: its state goes into ``state_save`` after the step, and comes from
        ``state_restore`` before it (`core.kv_cache.state_cache`)."""
        self.num_scheduled[req.request_id] = n
        self.new_block_ids[req.request_id] = block_ids
        self.budget -= n
        if state_save is not None:
            self.state_saves.append((req.request_id, state_save))
        if state_restore is not None:
            self.state_restores.append((req.request_id, state_restore))

    def drop(self, req: Request) -> None:
        self.budget += self.num_scheduled.pop(req.request_id, 0)
        self.new_block_ids.pop(req.request_id, None)
        self.spec.pop(req.request_id, None)
        rid = req.request_id
        self.state_restores = [p for p in self.state_restores if p[0] != rid]
        self.state_saves = [p for p in self.state_saves if p[0] != rid]


def step_output(
    step: StepPlan,
    requests: Mapping[str, Request],
    finished: frozenset[str],
    grammars: GrammarTracker | None,
    encoder_inputs: tuple = (),
) -> SchedulerOutput:
    """The contract message of ``step``; ``finished``: the requests finished since the
    last one. Advances each scheduled request's computed count (and, for one that
    samples, its output placeholders)."""
    new_reqs, cached_reqs, partial = [], [], set()
    for rid, n in step.num_scheduled.items():
        req = requests[rid]
        start = req.num_computed_tokens
        block_ids = tuple(step.new_block_ids[rid])
        if rid in step.first_time:
            new_reqs.append(
                NewRequestData(
                    rid,
                    tuple(req.prompt_token_ids),
                    req.sampling_params,
                    block_ids,
                    start,
                    req.eos_token_id,
                    req.lora_request,
                    tuple(item.placement() for item in req.mm_items),
                    tuple(item.grid for item in req.mm_items if item.grid is not None),
                )
            )
        else:
            tokens = (*req.all_token_ids[start : start + n], *step.spec.get(rid, ()))
            resumed = rid in step.resumed
            cached_reqs.append(CachedRequestData(rid, resumed, block_ids, start, tokens))
        req.num_computed_tokens = start + n
        if req.num_computed_tokens < req.num_tokens_with_placeholders:
            partial.add(rid)
        else:
            req.num_output_placeholders += 1
    masked, bitmask = (), None
    if grammars is not None:
        sampling = [requests[r] for r in step.num_scheduled if r not in partial]
        masked, bitmask = grammars.bitmask(sampling, step.spec)
    return SchedulerOutput(
        scheduled_new_reqs=tuple(new_reqs),
        scheduled_cached_reqs=tuple(cached_reqs),
        num_scheduled_tokens=dict(step.num_scheduled),
        total_num_scheduled_tokens=sum(step.num_scheduled.values()),
        partial_req_ids=frozenset(partial),
        finished_req_ids=finished,
        preempted_req_ids=frozenset(step.preempted),
        blocks_to_swap_out=tuple(step.swap_out),
        blocks_to_swap_in=tuple(step.swap_in),
        structured_output_req_ids=masked,
        grammar_bitmask=bitmask,
        scheduled_spec_decode_tokens=dict(step.spec),
        encoder_inputs=encoder_inputs,
        state_restores=tuple(step.state_restores),
        state_saves=tuple(step.state_saves),
    )
