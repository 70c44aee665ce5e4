"""Speculative decoding on the host: n-gram proposals, the config, the scheduler's
proposal and rollback accounting (against the fake paged runner), packing of the
logits rows, and the metrics."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from jaxengine.config import SpeculativeConfig
from jaxengine.core import RunnerOutput, Scheduler, SchedulerOutput
from jaxengine.core.sched_output import SchedulerStats, SpecDecodingStats
from jaxengine.engine_args import EngineArgs
from jaxengine.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from jaxengine.metrics.reader import Counter, Vector, get_metrics_snapshot
from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.buckets import BucketSet
from jaxengine.sampling_params import SamplingParams
from jaxengine.speculative import ProposalInput
from jaxengine.speculative.ngram import NgramProposer, propose_ngram
from jaxengine.structured_output import StructuredOutputManager
from tests.unit.test_scheduler import FakeRunner, fake_token, make_limits, make_req, run

# ---------------------------------------------------------------- n-gram proposals


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, want",
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 3, [4, 5, 1]),  # longest suffix [1 2 3]
        ([1, 2, 9, 3, 7, 2, 3], 1, 3, 2, [7, 2]),  # [2 3] absent: latest [3]
        ([1, 2, 9, 3, 7, 2, 3], 2, 3, 2, []),  # ... and n=1 is below min_n
        ([4, 8, 4, 9, 4], 1, 2, 1, [9]),  # the latest earlier occurrence
        ([5] * 9, 1, 3, 4, [5, 5, 5, 5]),  # the latest one followed by k ids
        ([5] * 4, 1, 3, 4, [5]),  # none is: the earliest, however short
        ([1, 2, 3], 1, 3, 2, []),
        ([7], 1, 3, 2, []),
    ],
)
def test_propose_ngram(tokens, min_n, max_n, k, want):
    assert propose_ngram(tokens, min_n, max_n, k) == want


def test_proposer_skips_keep_up_inputs_and_large_batches():
    def one(propose=True):
        return ProposalInput("r", [1, 2, 1], 2, [1], propose)

    proposer = NgramProposer(2, 1, 3, disable_by_batch_size=3)
    assert proposer.propose([one(), one(False)]) == [[2, 1], []]
    assert proposer.propose([one()] * 3) == [[], [], []]


# ---------------------------------------------------------------- config


def test_config_keys_defaults_and_method():
    c = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 5, 5,
    )  # fmt: skip
    c = SpeculativeConfig({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    assert SpeculativeConfig({"model": "x/EAGLE3-8B", "num_speculative_tokens": 1}).method == (
        "eagle3"
    )
    assert SpeculativeConfig().num_speculative_tokens == 0 and SpeculativeConfig().method is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}, "unknown key"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "magic", "num_speculative_tokens": 2}, "method 'magic' is not one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min \\(4\\) must be <="),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
         "disable_by_batch_size must be"),
    ],
)  # fmt: skip
def test_config_errors(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(options)


def test_engine_config_refusals():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    EngineArgs(speculative_config=ngram, num_lookahead_slots=2).create_engine_config()
    with pytest.raises(ValueError, match="num_lookahead_slots"):
        EngineArgs(speculative_config=ngram, num_lookahead_slots=3).create_engine_config()
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineArgs(speculative_config=ngram, async_scheduling=True).create_engine_config()
    eagle = {"method": "eagle", "model": "/m/eagle", "num_speculative_tokens": 2}
    EngineArgs(speculative_config=eagle).create_engine_config()
    with pytest.raises(NotImplementedError, match="method eagle3 is not supported yet"):
        EngineArgs(speculative_config={**eagle, "method": "eagle3"}).create_engine_config()
    draft = {"model": "/m/draft", "num_speculative_tokens": 2, "max_model_len": 64}
    with pytest.raises(NotImplementedError, match="max_model_len 64 is not supported yet"):
        EngineArgs(speculative_config=draft).create_engine_config()
    for method in ("draft_model", "eagle"):
        with pytest.raises(ValueError, match=f'the {method} method needs "model"'):
            SpeculativeConfig({"method": method, "num_speculative_tokens": 2})


# ---------------------------------------------------------------- scheduler


class SpecFakeRunner(FakeRunner):
    """`FakeRunner` with proposals: each request proposes ids that are right for a
    random count, then wrong. The proposed ids are written into the pages like the
    others, so a rejected one the scheduler forgot to take back would be read by a
    later step: every position a step reads must hold the request's true token."""

    def __init__(
        self, block_size: int, k: int, seed: int = 0, lookahead: int = 0, max_model_len: int = 0
    ) -> None:
        super().__init__(block_size)
        self.k, self.rng = k, random.Random(seed)
        self.lookahead, self.max_model_len = lookahead, max_model_len

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.forget_and_swap(so)
        starts = {}
        for nr in so.scheduled_new_reqs:
            self.state[nr.req_id] = {"tokens": list(nr.prompt_token_ids), "blocks": []}
            self.state[nr.req_id]["blocks"] = list(nr.block_ids)
            starts[nr.req_id] = nr.num_computed_tokens
        for cr in so.scheduled_cached_reqs:
            s = self.state[cr.req_id]
            s["blocks"] = [*([] if cr.resumed_from_preemption else s["blocks"]), *cr.new_block_ids]
            starts[cr.req_id] = cr.num_computed_tokens
            drafts = so.scheduled_spec_decode_tokens.get(cr.req_id, ())
            known = cr.new_token_ids[: len(cr.new_token_ids) - len(drafts)]
            at = cr.num_computed_tokens
            assert tuple(s["tokens"][at : at + len(known)]) == known
        req_ids, sampled, proposals = [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            req_ids.append(rid)
            sampled.append(self._verify(so, rid, starts[rid], n))
            proposals.append(self._propose(rid) if sampled[-1] else [])
        return RunnerOutput(req_ids, sampled, spec_token_ids=proposals)

    def _verify(self, so: SchedulerOutput, rid: str, start: int, n: int) -> list[int]:
        s, drafts = self.state[rid], so.scheduled_spec_decode_tokens.get(rid, ())
        for p in range(start):
            page, off = self._slot(s["blocks"], p)
            assert page[off] == s["tokens"][p], (rid, p)
        written = s["tokens"][start : start + n - len(drafts)] + list(drafts)
        assert len(written) == n
        if rid not in so.partial_req_ids and self.lookahead:  # the draft's slots exist
            room = min(start + n + self.lookahead, self.max_model_len)
            assert len(s["blocks"]) * self.bs >= room, (rid, start, n)
        for p, token in enumerate(written, start):
            page, off = self._slot(s["blocks"], p)
            page[off] = token
        if rid in so.partial_req_ids:
            return []
        tokens = []
        for j in range(len(drafts) + 1):  # the true token after each position
            tokens.append(fake_token(rid, start + n - len(drafts) + j))
            if j == len(drafts) or drafts[j] != tokens[-1]:
                break
        s["tokens"] += tokens
        return tokens

    def _propose(self, rid: str) -> list[int]:
        end = len(self.state[rid]["tokens"])
        right = self.rng.randint(0, self.k)
        true = [fake_token(rid, p) for p in range(end, end + self.k)]
        return true[:right] + [-1] * (self.k - right)


@pytest.mark.parametrize(
    "budget, blocks, lookahead, host",
    [(64, 65, 0, 0), (7, 65, 0, 0), (64, 14, 0, 0), (7, 65, 3, 0), (64, 16, 3, 0),
     (64, 16, 3, 40)],
)  # fmt: skip
def test_scheduler_verifies_and_takes_back_rejected_proposals(budget, blocks, lookahead, host):
    """Outputs are the true tokens whatever is accepted, stopping at max_tokens exactly,
    with chunked prefill (budget 7), preemption (14 or 16 pages; by swapping with host
    pages) and a draft model's lookahead slots (allocated past every sampling step);
    every page is free at the end (`run`); no step reads a rejected proposal's slot."""
    k = 3
    limits = make_limits(
        max_num_batched_tokens=budget, num_blocks=blocks, num_speculative_tokens=k,
        max_model_len=48, num_lookahead_tokens=lookahead, num_host_blocks=host,
    )  # fmt: skip
    sched = Scheduler(limits)
    for i in range(6):
        sched.add_request(make_req(f"r{i}", 5 + 3 * i, max_tokens=17 + i))
    runner = SpecFakeRunner(limits.block_size, k, lookahead=lookahead, max_model_len=48)
    tokens, reasons, outs = run(sched, runner)
    for i in range(6):
        start = 5 + 3 * i
        assert tokens[f"r{i}"] == [fake_token(f"r{i}", p) for p in range(start, start + 17 + i)]
    assert set(reasons.values()) == {"length"}
    assert (sched.num_preemptions > 0) == (blocks < 65)
    stats = sched.get_stats().spec_decoding
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    for so in outs:
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert 1 <= len(drafts) <= k and so.num_scheduled_tokens[rid] == 1 + len(drafts)


def test_proposals_stop_at_max_tokens_and_max_model_len():
    limits = make_limits(num_speculative_tokens=4, max_model_len=24)
    sched = Scheduler(limits)
    sched.add_request(make_req("a", 10, max_tokens=3))
    sched.add_request(make_req("b", 20, max_tokens=100))
    _, reasons, outs = run(sched, SpecFakeRunner(limits.block_size, 4, seed=1))
    assert reasons == {"a": "length", "b": "length"}
    for so in outs:
        for rid, n in so.num_scheduled_tokens.items():
            if rid in so.scheduled_spec_decode_tokens:
                computed = next(c for c in so.scheduled_cached_reqs if c.req_id == rid)
                assert computed.num_computed_tokens + n <= 23  # positions < max_model_len - 1
                if rid == "a":
                    assert n <= 3 - (computed.num_computed_tokens - 10)


# ---------------------------------------------------------------- packing


def test_buckets_and_logits_rows():
    buckets = BucketSet([4, 16, 64], max_num_seqs=8, logits_per_req=4)
    assert [(b.num_reqs, b.num_logits) for b in buckets.buckets] == [(4, 4), (8, 16), (8, 32)]
    chunks = [SeqChunk([1, 2, 3, 4], 0, [1]), SeqChunk([5, 6, 7], 4, [1, 2], num_logits=3)]
    batch = pack_batch(chunks, page_size=4, num_tokens=16, num_reqs=8, pages_per_req=4,
                       num_logits=16)  # fmt: skip
    assert batch.logits_indices[:5].tolist() == [3, 4, 5, 6, 0]
    with pytest.raises(ValueError, match="logits rows"):
        pack_batch(chunks, page_size=4, num_tokens=16, num_reqs=8, pages_per_req=4, num_logits=3)


# ---------------------------------------------------------------- metrics


def _stats(spec: SpecDecodingStats) -> SchedulerStats:
    return SchedulerStats(1, 0, 0, 0.5, 0, 0, 0, spec_decoding=spec)


def test_prometheus_counters_and_the_reader():
    logger = PrometheusStatLogger("m")
    logger.record(_stats(SpecDecodingStats(2, 6, 3, (2, 1, 0))), None)
    logger.record(_stats(SpecDecodingStats(5, 15, 9, (4, 3, 2))), None)
    metrics = {m.name: m for m in get_metrics_snapshot(logger.registry)}
    drafts = metrics["jaxengine:spec_decode_num_drafts"]
    assert isinstance(drafts, Counter) and drafts.value == 5
    assert drafts.labels == {"model_name": "m", "engine": "0"}
    assert metrics["jaxengine:spec_decode_num_draft_tokens"].value == 15
    assert metrics["jaxengine:spec_decode_num_accepted_tokens"].value == 9
    per_pos = metrics["jaxengine:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [4, 3, 2]
    assert metrics["jaxengine:num_requests_running"].value == 1


def test_no_speculative_series_without_it():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(1, 0, 0, 0.5, 0, 0, 0), None)
    assert not any("spec_decode" in m.name for m in get_metrics_snapshot(logger.registry))


def test_log_line_reports_the_window():
    clock = iter([0.0, 10.0, 20.0]).__next__
    logger = LoggingStatLogger(interval=5.0, clock=clock)
    logger.record(_stats(SpecDecodingStats(4, 12, 6, (3, 2, 1))), None)
    line = logger.log()
    assert "draft acceptance rate: 50.0%" in line and "mean acceptance length: 2.50" in line
    assert "per-position acceptance rate: 0.750, 0.500, 0.250" in line
    logger.record(_stats(SpecDecodingStats(6, 18, 6, (3, 2, 1))), None)
    assert "draft acceptance rate: 0.0%" in logger.log()


def test_spec_stats_observe():
    s = SpecDecodingStats().observe(3, 2).observe(2, 0).observe(4, 4)
    assert s == SpecDecodingStats(3, 9, 6, (2, 2, 1, 1))
    assert np.sum(s.accepted_per_pos) == s.num_accepted_tokens


# ---------------------------------------------------------------- structured outputs


def test_grammar_cuts_proposals_and_gives_a_mask_after_each():
    """FakeGrammar allows only (last + 1) % 64: proposals are cut at the first other
    id, and the rows after each proposal are the masks the grammar would give there;
    the grammar is where it was afterwards."""
    from tests.unit.test_structured_output import FakeBackend, so_req

    manager = StructuredOutputManager(FakeBackend(), vocab_size=64)
    req = so_req("g")
    deadline = time.monotonic() + 10
    while not manager.is_ready(req):  # compiled off the loop
        assert time.monotonic() < deadline
        time.sleep(0.01)
    manager.accept(req, [5])
    assert manager.check_drafts(req, (6, 7, 9, 10)) == (6, 7)
    ids, rows = manager.bitmask([req], {"g": (6, 7)})
    assert ids == ("g",) and rows.shape == (3, 2)
    allowed = [np.flatnonzero(np.unpackbits(r.view(np.uint8), bitorder="little")) for r in rows]
    assert [a.tolist() for a in allowed] == [[6], [7], [8]]
    _, again = manager.bitmask([req])
    assert np.array_equal(again[0], rows[0])


# ---------------------------------------------------------------- outputs


def test_a_stop_string_inside_one_steps_tokens(smollm2_tokenizer):
    """A step that brings several tokens (accepted proposals) meets the stop strings
    token by token: the output ends where one token per step would have ended it,
    its text, its token ids and its logprobs."""
    from jaxengine.core.sched_output import EngineCoreOutput
    from jaxengine.engine.output_processor import OutputProcessor

    tok = smollm2_tokenizer
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    three = next(j for j in range(len(ids)) if "three" in tok.decode(ids[: j + 1]))
    entries = [(-0.5, 1, [t], [-0.5]) for t in ids]
    params = SamplingParams(stop=[" three"], logprobs=0, max_tokens=50)
    proc = OutputProcessor(tok)
    (cid,) = proc.add("r", None, tok.encode("Count:"), params, 0.0)
    emitted, stops = proc.process([EngineCoreOutput(cid, list(ids), new_logprobs=entries)])
    (out,) = emitted[0].outputs
    assert stops == [(cid, " three")] and out.finish_reason == "stop"
    assert out.text == " one two"
    assert list(out.token_ids) == ids[: three + 1] and len(out.logprobs) == three + 1
