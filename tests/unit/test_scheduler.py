"""Scheduler: budget, chunking, prefix hits, preemption (recompute and swap), priority,
stops, aborts, and a random-operation model check for page leaks.

`FakeRunner` plays the device: it keeps a "KV cache" of token ids per page, checks that
every position a step attends to holds the right token (so a wrong block table, a bad
prefix hit or a lost swap shows up), and "samples" token = crc32(request id, position).
With async scheduling (`run(..., async_=True)`) each step is scheduled before the
previous one's update, and the runner feeds a token it sampled but the scheduler has
not seen yet, as the real runner does on device.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxengine.core import (
    Request,
    RequestStatus,
    RunnerOutput,
    Scheduler,
    SchedulerLimits,
    SchedulerOutput,
)

VOCAB = 1000


def fake_token(rid: str, pos: int) -> int:
    return zlib.crc32(f"{rid}:{pos}".encode()) % VOCAB


class FakeRunner:
    """Executes SchedulerOutputs against a simulated paged KV cache."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.state: dict[str, dict] = {}  # req id -> tokens, blocks
        self.num_fed = 0  # tokens fed from a sample the scheduler had not seen

    def _slot(self, blocks, p):
        return self.device.setdefault(blocks[p // self.bs], [None] * self.bs), p % self.bs

    def forget_and_swap(self, so: SchedulerOutput) -> None:
        """Drops finished requests; copies swapped pages out, then in."""
        for rid in so.finished_req_ids:
            self.state.pop(rid, None)
        for d, h in so.blocks_to_swap_out:
            self.host[h] = list(self.device.get(d, [None] * self.bs))
        for h, d in so.blocks_to_swap_in:
            self.device[d] = list(self.host.pop(h))

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.forget_and_swap(so)
        assert so.preempted_req_ids <= self.state.keys()
        starts = {}
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.state
            self.state[nr.req_id] = {
                "tokens": list(nr.prompt_token_ids),
                "blocks": list(nr.block_ids),
            }
            starts[nr.req_id] = nr.num_computed_tokens
        for cr in so.scheduled_cached_reqs:
            s = self.state[cr.req_id]
            if cr.resumed_from_preemption:
                s["blocks"] = list(cr.new_block_ids)
            else:
                s["blocks"].extend(cr.new_block_ids)
            n = so.num_scheduled_tokens[cr.req_id]
            start = starts[cr.req_id] = cr.num_computed_tokens
            known = len(cr.new_token_ids)
            assert tuple(s["tokens"][start : start + known]) == cr.new_token_ids
            if known < n:  # the last token is in flight: fed from the previous sample
                assert known == n - 1 and start + n == len(s["tokens"])
                self.num_fed += 1
        # Reads see only earlier steps' writes: check all, then write all.
        for rid, n in so.num_scheduled_tokens.items():
            s, start = self.state[rid], starts[rid]
            assert 0 not in s["blocks"] and len(s["blocks"]) * self.bs >= start + n
            for p in range(start):
                page, off = self._slot(s["blocks"], p)
                assert page[off] == s["tokens"][p], (rid, p)
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            s, start = self.state[rid], starts[rid]
            for p in range(start, start + n):
                page, off = self._slot(s["blocks"], p)
                page[off] = s["tokens"][p]
            if rid in so.partial_req_ids:
                sampled.append([])
            else:
                assert start + n == len(s["tokens"])
                s["tokens"].append(fake_token(rid, start + n))
                sampled.append([s["tokens"][-1]])
        return RunnerOutput(list(so.num_scheduled_tokens), sampled)


def make_limits(**kw) -> SchedulerLimits:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_blocks=65)
    base.update(block_size=4)
    base.update(kw)
    return SchedulerLimits(**base)


def make_req(rid, prompt, max_tokens=8, arrival=0.0, **kw):
    sp = SimpleNamespace(
        max_tokens=max_tokens,
        min_tokens=kw.pop("min_tokens", 0),
        ignore_eos=kw.pop("ignore_eos", False),
        stop_token_ids=kw.pop("stop_token_ids", None),
    )
    if isinstance(prompt, int):
        prompt = [(hash(rid) + i) % VOCAB for i in range(prompt)]
    return Request(rid, prompt, sp, arrival_time=arrival, **kw)


def check_step(sched: Scheduler, so: SchedulerOutput) -> None:
    lim = sched.limits
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= lim.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= lim.max_num_seqs
    assert len(sched.running) <= lim.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    check_consistency(sched)


def check_consistency(sched: Scheduler) -> None:
    sched.kv.check_invariants()
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        blocks = sched.kv.get_block_ids(req.request_id)
        assert len(blocks) * sched.limits.block_size >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        assert sched.kv.get_block_ids(req.request_id) == []
        assert sched.kv.is_swapped(req.request_id) == (req.status is RequestStatus.SWAPPED)
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    if kv.host_pool is not None:
        assert kv.num_free_host_blocks == kv.host_pool.num_blocks


def run(
    sched: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 5000,
    async_: bool = False,
):
    """Drive to completion (``async_``: each step scheduled before the previous one's
    update). Returns (tokens, finish reasons, SchedulerOutputs)."""
    runner = runner or FakeRunner(sched.limits.block_size)
    tokens, reasons, outs = {}, {}, []
    in_flight = None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            break
        so = sched.schedule()
        check_step(sched, so)
        outs.append(so)
        done = [(so, runner.execute(so))]
        if async_:
            done, in_flight = ([in_flight] if in_flight else []), done[0]
        for step in done:
            for o in sched.update(*step):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
        if async_ and so.is_empty:
            in_flight = None
    else:
        raise AssertionError("did not drain")
    assert_all_free(sched)
    return tokens, reasons, outs


# ---- budget and chunking -----------------------------------------------------------
def test_single_request_prefill_then_decode():
    sched = Scheduler(make_limits())
    sched.add_request(make_req("a", 10, max_tokens=5))
    tokens, reasons, outs = run(sched)
    assert tokens["a"] == [fake_token("a", p) for p in range(10, 15)]
    assert reasons == {"a": "length"}
    assert [o.total_num_scheduled_tokens for o in outs] == [10, 1, 1, 1, 1]
    assert len(outs[0].scheduled_new_reqs) == 1 and not outs[0].scheduled_cached_reqs
    assert outs[1].scheduled_cached_reqs[0].new_token_ids == (tokens["a"][0],)


def test_budget_respected_and_prompts_chunked():
    sched = Scheduler(make_limits(max_num_batched_tokens=16))
    sched.add_request(make_req("long", 40, max_tokens=3))
    sched.add_request(make_req("short", 5, max_tokens=3, arrival=1.0))
    tokens, _, outs = run(sched)
    assert [o.num_scheduled_tokens.get("long") for o in outs[:3]] == [16, 16, 8]
    assert "long" in outs[0].partial_req_ids and "long" not in outs[2].partial_req_ids
    # "short" joins as soon as the long prompt leaves room, in the same step.
    assert outs[2].num_scheduled_tokens["short"] == 5
    assert all(o.total_num_scheduled_tokens <= 16 for o in outs)
    assert tokens["long"] == [fake_token("long", p) for p in range(40, 43)]


def test_decodes_go_first():
    sched = Scheduler(make_limits(max_num_batched_tokens=16))
    runner = FakeRunner(4)
    sched.add_request(make_req("a", 4, max_tokens=20))
    so = sched.schedule()
    sched.update(so, runner.execute(so))
    sched.add_request(make_req("b", 100, max_tokens=2, arrival=1.0))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}


def test_max_num_seqs_caps_running():
    sched = Scheduler(make_limits(max_num_seqs=2))
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 3, max_tokens=2, arrival=i))
    outs = run(sched)[2]
    assert list(outs[0].num_scheduled_tokens) == ["r0", "r1"]
    assert max(len(o.num_scheduled_tokens) for o in outs) == 2


def test_without_chunked_prefill_a_prompt_waits_for_room():
    lim = make_limits(enable_chunked_prefill=False, max_num_batched_tokens=128)
    sched = Scheduler(lim)
    sched.add_request(make_req("a", 100, max_tokens=2))
    sched.add_request(make_req("b", 50, max_tokens=2, arrival=1.0))
    outs = run(sched)[2]
    assert outs[0].num_scheduled_tokens == {"a": 100}
    assert outs[1].num_scheduled_tokens == {"a": 1, "b": 50}
    assert not any(o.partial_req_ids for o in outs)
    with pytest.raises(ValueError, match="max_model_len"):
        make_limits(enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_long_prefill_threshold_caps_chunks():
    sched = Scheduler(make_limits(long_prefill_token_threshold=8, max_num_partial_prefills=2))
    sched.add_request(make_req("a", 20, max_tokens=1))
    outs = run(sched)[2]
    assert [o.num_scheduled_tokens["a"] for o in outs] == [8, 8, 4]


@pytest.mark.parametrize("partial,long", [(1, 1), (3, 1), (3, 2)])
def test_partial_prefill_limits(partial, long):
    lim = make_limits(
        max_num_batched_tokens=32,
        long_prefill_token_threshold=10,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=long,
    )
    sched = Scheduler(lim)
    sched.add_request(make_req("big1", 40, max_tokens=1))
    sched.add_request(make_req("big2", 40, max_tokens=1, arrival=1.0))
    sched.add_request(make_req("small", 3, max_tokens=1, arrival=2.0))
    outs = run(sched)[2]
    if long == 1:  # big2 waits while big1 is part-way; small jumps ahead
        assert outs[0].num_scheduled_tokens == {"big1": 10, "small": 3}
    else:
        assert outs[0].num_scheduled_tokens == {"big1": 10, "big2": 10, "small": 3}
    for o in outs:  # never more partial prefills at once than allowed
        assert len(o.partial_req_ids) <= min(partial, long)


def test_prompt_too_long_and_duplicate_rejected():
    sched = Scheduler(make_limits())
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", 129))
    sched.add_request(make_req("a", 5))
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", 5))
    with pytest.raises(ValueError, match="cannot hold"):
        make_limits(num_blocks=8)


# ---- prefix caching ----------------------------------------------------------------
def test_prefix_hit_computes_only_the_rest():
    sched = Scheduler(make_limits())
    runner = FakeRunner(4)  # one device: the KV of "a" must be what "b" reads
    shared = list(range(100, 140))  # 40 tokens = 10 blocks
    sched.add_request(make_req("a", shared + [1, 2, 3], max_tokens=2))
    run(sched, runner)
    sched.add_request(make_req("b", shared + [7, 8], max_tokens=2))
    tokens, _, outs = run(sched, runner)
    assert outs[0].num_scheduled_tokens == {"b": 2}
    assert outs[0].scheduled_new_reqs[0].num_computed_tokens == 40
    stats = sched.get_stats()
    assert stats.prefix_cache_hits == 40 and stats.prefix_cache_queries == 43 + 42
    assert tokens["b"] == [fake_token("b", 42), fake_token("b", 43)]


def test_same_step_requests_do_not_share_uncomputed_blocks():
    sched = Scheduler(make_limits())
    sched.add_request(make_req("a", list(range(20)), max_tokens=1))
    sched.add_request(make_req("b", list(range(20)), max_tokens=1))
    outs = run(sched)[2]
    assert outs[0].num_scheduled_tokens == {"a": 20, "b": 20}


def test_prefix_caching_disabled():
    sched = Scheduler(make_limits(enable_prefix_caching=False))
    runner = FakeRunner(4)
    sched.add_request(make_req("a", list(range(20)), max_tokens=1))
    run(sched, runner)
    sched.add_request(make_req("b", list(range(20)), max_tokens=1))
    assert run(sched, runner)[2][0].num_scheduled_tokens == {"b": 20}
    assert sched.get_stats().prefix_cache_queries == 0


# ---- preemption --------------------------------------------------------------------
def _preemption_workload(sched: Scheduler) -> None:
    for i in range(6):
        sched.add_request(make_req(f"r{i}", 9 + 3 * i, max_tokens=24, arrival=i))


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_resume_with_identical_output(host_blocks, caching, async_):
    ref = Scheduler(make_limits(enable_prefix_caching=caching))
    _preemption_workload(ref)
    ref_tokens, ref_reasons, _ = run(ref)
    assert ref.num_preemptions == 0
    lim = make_limits(
        num_blocks=17, max_model_len=64, num_host_blocks=host_blocks, enable_prefix_caching=caching
    )
    sched = Scheduler(lim)
    _preemption_workload(sched)
    tokens, reasons, outs = run(sched, async_=async_)
    assert sched.num_preemptions > 0
    assert tokens == ref_tokens and reasons == ref_reasons
    swapped = any(o.blocks_to_swap_out for o in outs)
    assert swapped == bool(host_blocks)
    assert any(o.blocks_to_swap_in for o in outs) == bool(host_blocks)
    resumed = [c for o in outs for c in o.scheduled_cached_reqs if c.resumed_from_preemption]
    assert resumed


# ---- async scheduling --------------------------------------------------------------
def test_async_steps_feed_the_token_in_flight_and_stop_at_max_tokens():
    sync, asyn = Scheduler(make_limits()), Scheduler(make_limits())
    for sched in (sync, asyn):
        sched.add_request(make_req("a", 10, max_tokens=5))
    runner = FakeRunner(4)
    ref_tokens, ref_reasons, _ = run(sync)
    tokens, reasons, outs = run(asyn, runner, async_=True)
    assert tokens == ref_tokens and reasons == ref_reasons == {"a": "length"}
    # 4 decodes, each fed the token still in flight; none computed past max_tokens
    assert [o.total_num_scheduled_tokens for o in outs] == [10, 1, 1, 1, 1, 0]
    assert runner.num_fed == 4
    assert all(not c.new_token_ids for o in outs[1:] for c in o.scheduled_cached_reqs)


def test_async_eos_costs_one_discarded_step_and_nothing_else():
    eos = fake_token("a", 13)  # the 4th sampled token
    sync, asyn = Scheduler(make_limits()), Scheduler(make_limits())
    for sched in (sync, asyn):
        sched.add_request(make_req("a", 10, max_tokens=50, eos_token_id=eos))
        sched.add_request(make_req("b", 6, max_tokens=9, arrival=1.0))
    ref_tokens, ref_reasons, ref_outs = run(sync)
    tokens, reasons, outs = run(asyn, async_=True)
    assert tokens == ref_tokens and reasons == ref_reasons
    assert tokens["a"][-1] == eos and reasons["a"] == "stop"
    computed_a = [o.num_scheduled_tokens.get("a", 0) for o in outs]
    assert sum(computed_a) == sum(o.num_scheduled_tokens.get("a", 0) for o in ref_outs) + 1


def test_request_preempted_with_a_token_in_flight_still_gets_it():
    from jaxengine.core.step_plan import StepPlan as _Step

    sched = Scheduler(make_limits())
    runner = FakeRunner(4)
    sched.add_request(make_req("a", 10, max_tokens=5))
    first = sched.schedule()
    a = sched.requests["a"]
    assert a.num_output_placeholders == 1
    # the next schedule() preempts it (recompute) while the first step is in flight
    sched._preempt(a, step := _Step(0))
    assert not step.swap_out and a.status is RequestStatus.PREEMPTED
    out = sched.update(first, runner.execute(first))
    assert out[0].new_token_ids == [fake_token("a", 10)]
    assert a.num_output_tokens == 1 and a.num_output_placeholders == 0
    tokens, reasons, _ = run(sched, runner, async_=True)
    assert [fake_token("a", 10), *tokens["a"]] == [fake_token("a", p) for p in range(10, 15)]
    assert reasons == {"a": "length"}


def test_recompute_preemption_state():
    sched = Scheduler(make_limits(num_blocks=5, max_model_len=16, max_num_batched_tokens=16))
    runner = FakeRunner(4)
    sched.add_request(make_req("a", 7, max_tokens=8))
    sched.add_request(make_req("b", 7, max_tokens=8, arrival=1.0))
    preempted = None
    for _ in range(20):
        so = sched.schedule()
        sched.update(so, runner.execute(so))
        if so.preempted_req_ids:
            preempted = so
            break
    assert preempted.preempted_req_ids == {"b"}  # fcfs: the latest arrival
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens > 0 and sched.kv.get_block_ids("b") == []
    assert sched.waiting.peek() is b
    run(sched, runner)


def test_priority_order_and_victim():
    sched = Scheduler(make_limits(scheduling_policy="priority", max_num_seqs=1))
    sched.add_request(make_req("low", 4, max_tokens=1, priority=5, arrival=0.0))
    sched.add_request(make_req("high", 4, max_tokens=1, priority=-1, arrival=1.0))
    sched.add_request(make_req("mid", 4, max_tokens=1, priority=0, arrival=2.0))
    sched.add_request(make_req("mid0", 4, max_tokens=1, priority=0, arrival=1.5))
    outs = run(sched)[2]
    assert [next(iter(o.num_scheduled_tokens)) for o in outs] == ["high", "mid0", "mid", "low"]

    lim = make_limits(scheduling_policy="priority", num_blocks=5, max_model_len=16)
    sched = Scheduler(lim)
    runner = FakeRunner(4)
    sched.add_request(make_req("x", 6, max_tokens=8, priority=9, arrival=0.0))
    sched.add_request(make_req("y", 6, max_tokens=8, priority=0, arrival=1.0))
    for _ in range(20):
        so = sched.schedule()
        sched.update(so, runner.execute(so))
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"x"}  # lowest priority, though it came first
            break
    else:
        raise AssertionError("no preemption")
    run(sched, runner)


# ---- stops, finishing, aborts ------------------------------------------------------
def _first_step_tokens(rid, prompt_len, k):
    return [fake_token(rid, prompt_len + i) for i in range(k)]


def test_stop_conditions():
    toks = _first_step_tokens("s", 5, 6)
    sched = Scheduler(make_limits())
    sched.add_request(make_req("s", 5, max_tokens=20, stop_token_ids=[toks[2]]))
    sched.add_request(make_req("e", 5, max_tokens=20, eos_token_id=fake_token("e", 5)))
    sched.add_request(
        make_req("i", 5, max_tokens=4, eos_token_id=fake_token("i", 5), ignore_eos=True)
    )
    sched.add_request(
        make_req("m", 5, max_tokens=20, eos_token_id=fake_token("m", 5), min_tokens=3)
    )
    sched.add_request(make_req("L", 120, max_tokens=None))
    tokens, reasons, outs = run(sched)
    assert tokens["s"] == toks[:3] and reasons["s"] == "stop"
    assert len(tokens["e"]) == 1 and reasons["e"] == "stop"
    assert len(tokens["i"]) == 4 and reasons["i"] == "length"
    eos_m = fake_token("m", 5)
    later = [i for i in range(2, 20) if fake_token("m", 5 + i) == eos_m]
    assert tokens["m"][0] == eos_m  # EOS ignored below min_tokens
    assert len(tokens["m"]) == (later[0] + 1 if later else 20)
    assert len(tokens["L"]) == 8 and reasons["L"] == "length"  # max_model_len 128
    assert "s" in outs[3].finished_req_ids  # the runner is told on the next step


def test_stop_reason_reported():
    tok = fake_token("s", 5)
    sched = Scheduler(make_limits())
    sched.add_request(make_req("s", 5, stop_token_ids=[tok]))
    so = sched.schedule()
    (out,) = sched.update(so, FakeRunner(4).execute(so))
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.new_token_ids == [tok]


def test_finish_requests_for_string_stops():
    sched = Scheduler(make_limits())
    runner = FakeRunner(4)
    sched.add_request(make_req("a", 5, max_tokens=50))
    so = sched.schedule()
    sched.update(so, runner.execute(so))
    sched.finish_requests("a", stop_reason="</s>")
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}
    assert_all_free(sched)


@pytest.mark.parametrize("host_blocks", [0, 64])
def test_abort_frees_pages_in_every_state(host_blocks):
    lim = make_limits(num_blocks=9, max_model_len=32, num_host_blocks=host_blocks)
    sched = Scheduler(lim)
    runner = FakeRunner(4)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 10, max_tokens=20, arrival=i))
    seen = set()
    for _ in range(12):
        so = sched.schedule()
        check_step(sched, so)
        ro = runner.execute(so)
        sched.abort_requests(["r4"])  # between schedule and update: skipped in update
        sched.update(so, ro)
        seen |= {r.status for r in sched.requests.values()}
    assert RequestStatus.RUNNING in seen and RequestStatus.WAITING in seen
    assert (RequestStatus.SWAPPED if host_blocks else RequestStatus.PREEMPTED) in seen
    sched.abort_requests(list(sched.requests))
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)
    assert sched.schedule().is_empty


def test_update_skips_unknown_and_passes_logprobs():
    sched = Scheduler(make_limits())
    sched.add_request(make_req("a", 5, max_tokens=3))
    so = sched.schedule()
    ro = RunnerOutput(
        ["a", "ghost"], [[1], [2]], logprobs=["LP", None], prompt_logprobs=["P", None]
    )
    (out,) = sched.update(so, ro)
    assert out.new_logprobs == "LP" and out.new_prompt_logprobs == "P" and out.new_token_ids == [1]


def test_from_configs():
    cfg = pytest.importorskip("jaxengine.config")
    sc = cfg.SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=512, enable_chunked_prefill=True
    )
    cc = cfg.CacheConfig(block_size=16, swap_space=1)
    lim = SchedulerLimits.from_configs(
        sc, cc, num_blocks=100, max_model_len=1024, bytes_per_block=1 << 20
    )
    assert lim.num_host_blocks == 1024 and lim.enable_chunked_prefill and lim.block_size == 16
    assert lim.enable_prefix_caching and lim.prefix_caching_hash_algo == cc.prefix_caching_hash_algo
    sc2 = cfg.SchedulerConfig(
        max_num_partial_prefills=2,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_chunked_prefill=True,
    )
    lim2 = SchedulerLimits.from_configs(sc2, cc, num_blocks=100, max_model_len=1000)
    assert lim2.long_prefill_token_threshold == 40 and lim2.num_host_blocks == 0
    with pytest.raises(ValueError, match="unresolved config fields: block_size, max_num_seqs"):
        SchedulerLimits.from_configs(cfg.SchedulerConfig(), cfg.CacheConfig(), 100, 1000)


# ---- random operations: no page leak, consistent ref counts -----------------------
PREFIXES = [list(range(1000, 1040)), list(range(2000, 2013)), []]


def _random_limits(rng: random.Random) -> SchedulerLimits:
    bs = rng.choice([1, 2, 4, 8])
    max_len = rng.choice([16, 32, 64])
    chunked = rng.random() < 0.7
    return SchedulerLimits(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(max_len if not chunked else 1, 96),
        max_model_len=max_len,
        num_blocks=-(-max_len // bs) + 1 + rng.randint(0, 24),
        block_size=bs,
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=(p := rng.randint(1, 3)) if chunked else 1,
        max_long_partial_prefills=rng.randint(1, p) if chunked else 1,
        long_prefill_token_threshold=rng.choice([0, 0, 5]),
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_prefix_caching=rng.random() < 0.8,
        prefix_caching_hash_algo=rng.choice(["builtin", "sha256"]),
        num_host_blocks=rng.choice([0, 0, 4, 40]),
    )


class SchedulerOps:
    """The operations a random test applies; each keeps every invariant. With
    ``async_`` each step is scheduled before the previous one's update."""

    def __init__(self, rng: random.Random, async_: bool = False) -> None:
        self.rng = rng
        self.sched = Scheduler(_random_limits(rng))
        self.runner = FakeRunner(self.sched.limits.block_size)
        self.async_ = async_
        self.in_flight = None
        self.n = 0

    def add(self) -> None:
        rng, lim = self.rng, self.sched.limits
        prefix = rng.choice(PREFIXES)[: lim.max_model_len - 1]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        prompt = (prefix + tail)[: lim.max_model_len]
        self.n += 1
        req = make_req(
            f"q{self.n}",
            prompt,
            max_tokens=rng.choice([1, 3, 10, None]),
            arrival=self.n,
            priority=rng.randint(0, 3),
            eos_token_id=rng.choice([None, 7]),
            cache_salt=rng.choice([None, None, "s"]),
        )
        self.sched.add_request(req)

    def step(self) -> None:
        so = self.sched.schedule()
        check_step(self.sched, so)
        done = (so, self.runner.execute(so))
        if self.async_:
            done, self.in_flight = self.in_flight, done
        if done is not None:
            self.sched.update(*done)

    def finish_one(self, abort: bool) -> None:
        if self.sched.requests:
            rid = self.rng.choice(sorted(self.sched.requests))
            if abort:
                self.sched.abort_requests([rid])
            else:
                self.sched.finish_requests(rid, stop_reason="stop-string")

    def drain(self) -> None:
        for _ in range(3000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        if self.in_flight is not None:
            self.sched.update(*self.in_flight)
        assert not self.sched.has_unfinished_requests(), "scheduler stalled"
        assert_all_free(self.sched)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(40))
def test_random_operations_never_leak(seed, async_):
    rng = random.Random(seed)
    ops = SchedulerOps(rng, async_)
    for _ in range(120):
        r = rng.random()
        if r < 0.3:
            ops.add()
        elif r < 0.9:
            ops.step()
        else:
            ops.finish_one(abort=r < 0.95)
        check_consistency(ops.sched)
    ops.drain()


class SchedulerMachine(RuleBasedStateMachine):
    """Hypothesis-driven version: shrinks a failing operation sequence."""

    @initialize(seed=st.integers(0, 2**16), async_=st.booleans())
    def start(self, seed, async_):
        self.ops = SchedulerOps(random.Random(seed), async_)

    @rule()
    def add(self):
        self.ops.add()

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self.ops.step()

    @rule(abort=st.booleans())
    def finish(self, abort):
        self.ops.finish_one(abort)

    @invariant()
    def consistent(self):
        check_consistency(self.ops.sched)

    def teardown(self):
        if hasattr(self, "ops"):
            self.ops.drain()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
