"""Prefix caching for a hybrid model's linear-attention states (`core.kv_cache.
state_cache`), host side: the row bookkeeping, and the scheduler driving a fake runner
whose "state" of a request is the tuple of tokens it has absorbed, so a restore from
the wrong row, a save at the wrong place or a hit without a saved state shows up as
a state that is not the request's tokens before its chunk."""

from __future__ import annotations

import random

import pytest

from jaxengine.core import Scheduler
from jaxengine.core.kv_cache.state_cache import StateCache
from tests.unit.test_scheduler import FakeRunner, make_limits, make_req, run

ROWS = (8, 3)  # saved states in pool rows 8, 9, 10 (after 8 request slots)


class StateRunner(FakeRunner):
    """`FakeRunner` plus the states: each request's slot holds the tokens it has
    absorbed; saved rows hold copies."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.slots: dict[str, tuple] = {}
        self.rows: dict[int, tuple] = {}
        self.restored = 0
        self.saved: list[tuple[int, int]] = []  # (row, tokens) of each save

    def execute(self, so):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.slots.pop(rid, None)
        restores = dict(so.state_restores)
        starts = {}
        for rid in so.num_scheduled_tokens:
            start = starts[rid] = self._start(so, rid)
            if rid in restores:
                self.slots[rid] = self.rows[restores[rid]]
                self.restored += 1
            elif start == 0:
                self.slots[rid] = ()
            tokens = self._tokens(so, rid)
            assert self.slots[rid] == tuple(tokens[:start]), (rid, start)
        out = super().execute(so)
        for rid, n in so.num_scheduled_tokens.items():  # (with a token fed in flight too)
            self.slots[rid] = tuple(self.state[rid]["tokens"][: starts[rid] + n])
        for rid, row in so.state_saves:
            assert len(self.slots[rid]) % self.bs == 0
            self.rows[row] = self.slots[rid]
            self.saved.append((row, len(self.slots[rid])))
        return out

    def _start(self, so, rid: str) -> int:
        new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = {r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs}
        return new[rid] if rid in new else cached[rid]

    def _tokens(self, so, rid: str) -> list:
        for r in so.scheduled_new_reqs:
            if r.req_id == rid:
                return list(r.prompt_token_ids)
        known = list(self.state[rid]["tokens"])
        cr = next(r for r in so.scheduled_cached_reqs if r.req_id == rid)
        return known[: cr.num_computed_tokens] + list(cr.new_token_ids)


def _hybrid_sched(**kw) -> Scheduler:
    return Scheduler(make_limits(state_cache_rows=ROWS, **kw))


def test_rows_by_hash_lru_and_rolling():
    cache = StateCache(*ROWS)
    assert cache.reserve("a", 0, rolling=False) == 8
    assert cache.usable_blocks(["h0"], 1) == 0  # not published until its tokens are known
    cache.publish("a", ["h0"], 1)
    assert cache.usable_blocks(["h0", "h1"], 2) == 1 and cache.row_for("h0") == 8
    row = cache.reserve("a", 1, rolling=True)
    cache.publish("a", ["h0", "h1"], 2)
    again = cache.reserve("a", 2, rolling=True)  # the next rolling save reuses its row
    assert again == row and cache.usable_blocks(["h0", "h1"], 2) == 1
    cache.publish("a", ["h0", "h1", "h2"], 3)
    cache.reserve("b", 0, rolling=False)
    cache.check_invariants()
    assert cache.reserve("c", 0, rolling=False) == 8  # every row used: "h0" is the oldest
    assert cache.reserve("d", 0, rolling=False) == again  # then "h2" (h0's hit renewed it)
    assert cache.reserve("e", 0, rolling=False) is None  # all three wait for their saves
    cache.drop("b")
    cache.check_invariants()
    cache.reset()
    assert len(cache) == 0
    cache.check_invariants()


def test_partial_prefill_ends_at_block_end_and_saves_there():
    sched = _hybrid_sched(max_num_batched_tokens=10, block_size=4)
    sched.add_request(make_req("a", 23, max_tokens=6))
    runner = StateRunner(4)
    _, _, outs = run(sched, runner)
    prefill = [o.num_scheduled_tokens["a"] for o in outs[:3]]
    assert prefill == [8, 8, 7]  # 10-token budget, chunks end at 8 and 16
    assert [n for _, n in runner.saved] == [8, 16, 24, 28]
    rows = [row for row, _ in runner.saved]
    assert rows[2] == rows[3] != rows[1]  # decode's rolling save: one row, the latest


@pytest.mark.parametrize("async_", [False, True])
def test_hits_resume_from_saved_states(async_):
    """Shared prefixes, a second round of the same prompts, few pages (preemption):
    every chunk starts from the state of exactly the tokens before it."""
    rng = random.Random(0)
    sched = _hybrid_sched(max_num_batched_tokens=12, block_size=4, num_blocks=12, max_model_len=40)
    runner = StateRunner(4)
    base = [rng.randrange(1000) for _ in range(20)]
    prompts = [base[: rng.randrange(9, 20)] + [rng.randrange(1000)] for _ in range(6)]
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            sched.add_request(make_req(f"{round_}-{i}", prompt, max_tokens=rng.randrange(1, 9)))
        run(sched, runner, async_=async_)
    assert runner.restored > 0 and sched.kv.prefix_hits > 0
    assert sched.num_preemptions > 0
    sched.kv.check_invariants()


def test_hit_stops_at_the_last_saved_state():
    """Pages are cached for every full block, states only where a chunk ended: the hit
    is the longest prefix ending at a saved state."""
    sched = _hybrid_sched(max_num_batched_tokens=8, block_size=4)
    prompt = list(range(30))
    sched.add_request(make_req("a", prompt, max_tokens=1))
    run(sched, StateRunner(4))
    sched.add_request(make_req("b", prompt[:22] + [999, 998], max_tokens=1))
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 16  # pages up to 20, states at 8, 16 and 24
    assert [rid for rid, _ in so.state_restores] == ["b"]
