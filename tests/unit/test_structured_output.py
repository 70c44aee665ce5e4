"""Structured outputs on the host: the manager (compile off the loop, cache, bitmask,
accept, reasoning), the scheduler holding requests until their grammar is ready, and
the llguidance backend's grammars and errors. No model and no jax."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from jaxengine.core import Scheduler
from jaxengine.sampling_params import StructuredOutputsParams
from jaxengine.structured_output import StructuredOutputManager
from jaxengine.structured_output.guidance import close_objects
from tests.unit.test_scheduler import FakeRunner, make_limits, make_req, run


class FakeGrammar:
    """Allows token (last accepted + 1) % 64 only; terminates after `length` tokens."""

    def __init__(self, length: int = 3) -> None:
        self.tokens: list[int] = []
        self.length = length

    def accept_tokens(self, token_ids):
        self.tokens.extend(token_ids)
        return True

    def fill_bitmask(self, bitmask, row):
        nxt = (self.tokens[-1] + 1) % 64 if self.tokens else 0
        bitmask[row] = 0
        bitmask[row, nxt // 32] = np.int32(np.uint32(1 << (nxt % 32)).view(np.int32))

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n :]

    def validate_tokens(self, token_ids):
        last, count = (self.tokens[-1] if self.tokens else -1), 0
        for token in token_ids:
            if token != (last + 1) % 64:
                break
            last, count = token, count + 1
        return count

    def is_terminated(self):
        return len(self.tokens) >= self.length

    def copy(self):
        return FakeGrammar(self.length)


class FakeBackend:
    name = "fake"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.compiled: list[str] = []

    def grammar_key(self, params):
        if params.regex == "bad":
            raise ValueError("cannot express this")
        return f"{params.kind}:{params.regex or params.json}"

    def validate(self, key):
        if "invalid" in key:
            raise ValueError("syntax error at 1")

    def compile(self, key):
        self.gate.wait(10)
        self.compiled.append(key)
        if "broken" in key:
            raise ValueError("compile failed")
        return FakeGrammar()

    def fill_bitmasks(self, grammars, bitmask):
        for grammar, row in grammars:
            grammar.fill_bitmask(bitmask, row)


def so_req(rid, regex="[a-z]+", prompt=6, max_tokens=5):
    req = make_req(rid, prompt, max_tokens=max_tokens)
    req.sampling_params.structured_outputs = StructuredOutputsParams(regex=regex)
    return req


def wait_ready(manager, req):
    for _ in range(200):
        if manager.is_ready(req):
            return
        time.sleep(0.01)
    raise AssertionError("grammar never ready")


def test_validate_names_the_constraint():
    manager = StructuredOutputManager(FakeBackend(), 64)
    with pytest.raises(ValueError, match=r"invalid structured_outputs.regex: syntax error"):
        manager.validate(
            SimpleNamespace(structured_outputs=StructuredOutputsParams(regex="invalid"))
        )
    manager.validate(SimpleNamespace(structured_outputs=None))


def test_compile_off_the_loop_cached_and_copied_per_request():
    backend = FakeBackend()
    backend.gate.clear()
    manager = StructuredOutputManager(backend, 64)
    a, b, free = so_req("a"), so_req("b"), make_req("free", 4)
    assert manager.is_ready(free)
    assert not manager.is_ready(a) and not manager.is_ready(b)  # compiling, not blocking
    backend.gate.set()
    wait_ready(manager, a)
    wait_ready(manager, b)
    assert backend.compiled == ["regex:[a-z]+"]  # one compile for one spec
    assert manager._states["a"].grammar is not manager._states["b"].grammar
    a.output_token_ids.append(0)
    manager.accept(a, [0])
    ids, mask = manager.bitmask([free, a, b])
    assert ids == ("a", "b") and mask.shape == (2, 2)
    assert mask[0, 0] == 2 and mask[1, 0] == 1  # a allows token 1, b token 0
    manager.free("a")
    assert manager.bitmask([a])[0] == ()


def test_reasoning_delays_the_grammar_until_the_end_marker():
    end = 50
    reasoner = SimpleNamespace(
        is_reasoning_end=lambda ids: end in ids,
        content_token_ids=lambda ids: list(ids[ids.index(end) + 1 :]) if end in ids else [],
    )
    manager = StructuredOutputManager(FakeBackend(), 64, reasoner=reasoner)
    req = so_req("r")
    wait_ready(manager, req)
    for step in ([7], [8], [end, 0]):  # thinking, then the marker and one content token
        assert manager.bitmask([req])[0] == ()
        req.output_token_ids.extend(step)
        manager.accept(req, step)
    ids, mask = manager.bitmask([req])
    assert ids == ("r",) and mask[0, 0] == 2  # content so far: [0] -> next is 1
    assert manager._states["r"].grammar.tokens == [0]
    closed = so_req("closed", prompt=[3, end, 4])  # the template closed the reasoning
    wait_ready(manager, closed)
    assert manager.bitmask([closed])[0] == ("closed",)


def test_scheduler_admits_others_while_a_grammar_compiles():
    backend = FakeBackend()
    backend.gate.clear()
    sched = Scheduler(make_limits(), StructuredOutputManager(backend, 1000))
    sched.add_request(so_req("c"))
    sched.add_request(make_req("f", 6))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["f"] and so.grammar_bitmask is None
    backend.gate.set()
    time.sleep(0.05)
    runner = FakeRunner(sched.limits.block_size)
    sched.update(so, runner.execute(so))
    so = sched.schedule()
    assert "c" in so.num_scheduled_tokens
    assert so.structured_output_req_ids == ("c",) and so.grammar_bitmask.shape == (1, 32)
    sched.update(so, runner.execute(so))
    tokens, reasons, _ = run(sched, runner)
    assert reasons == {"c": "length", "f": "length"}
    assert not sched.grammars._states


def test_partial_prefills_get_no_bitmask_row():
    sched = Scheduler(
        make_limits(max_num_batched_tokens=8), StructuredOutputManager(FakeBackend(), 1000)
    )
    sched.add_request(so_req("long", prompt=20))
    wait_ready(sched.grammars, sched.requests["long"])
    outs = run(sched)[2]
    for so in outs:
        sampling = "long" in so.num_scheduled_tokens and "long" not in so.partial_req_ids
        assert so.structured_output_req_ids == (("long",) if sampling else ())


def test_a_grammar_that_fails_to_compile_aborts_only_its_request():
    sched = Scheduler(make_limits(), StructuredOutputManager(FakeBackend(), 1000))
    sched.add_request(so_req("bad", regex="broken"))
    sched.add_request(make_req("ok", 5))
    tokens, reasons, _ = run(sched)
    assert reasons == {"bad": "abort", "ok": "length"}
    assert len(tokens["ok"]) == 8


def test_close_objects_closes_every_object_schema_once():
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "inner": {"properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object"}},
        },
        "anyOf": [{"type": "object"}],
        "$defs": {"d": {"type": "object"}},
        "enum": [{"type": "object"}],
    }
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["type"]
    assert out["enum"] == [{"type": "object"}]  # values, not schemas
    assert "additionalProperties" not in schema  # a copy


def test_config_checks_the_json_options():
    from jaxengine.config import StructuredOutputsConfig
    from jaxengine.engine_args import EngineArgs

    assert StructuredOutputsConfig().backend == "guidance"  # auto
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bakend'\]"):
        StructuredOutputsConfig(structured_outputs_config={"bakend": "guidance"})
    with pytest.raises(ValueError, match="backend 'lmfe' is not one of"):
        StructuredOutputsConfig(structured_outputs_config={"backend": "lmfe"})
    with pytest.raises(ValueError, match="disagree"):
        StructuredOutputsConfig({"reasoning_parser": "qwen3"}, reasoning_parser="deepseek_r1")
    config = StructuredOutputsConfig({"reasoning_parser": "qwen3"})
    assert config.reasoning_parser_name == "qwen3"
    with pytest.raises(NotImplementedError, match="backend xgrammar is not supported yet"):
        EngineArgs(structured_outputs_config={"backend": "xgrammar"}).create_engine_config()


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
def test_grammars_follow_every_token_through_preemption(host_blocks):
    """Under preemption (recompute or swap) every sampled token reaches its grammar
    exactly once, and a bitmask row is sent for exactly the steps that sample."""
    backend = FakeBackend()
    backend.compile = lambda key: FakeGrammar(length=1000)
    manager = StructuredOutputManager(backend, 1000)
    fed: dict[str, list[int]] = {}
    free = manager.free

    def record(rid):
        state = manager._states.get(rid)
        if state is not None and state.grammar is not None:
            fed[rid] = list(state.grammar.tokens)
        free(rid)

    manager.free = record
    lim = make_limits(num_blocks=17, max_model_len=64, num_host_blocks=host_blocks)
    sched = Scheduler(lim, manager)
    for i in range(6):
        req = so_req(f"r{i}", prompt=9 + 3 * i, max_tokens=24)
        req.arrival_time = i
        sched.add_request(req)
    time.sleep(0.05)  # compiles finish off the loop
    tokens, reasons, outs = run(sched)
    assert sched.num_preemptions > 0
    assert fed == tokens  # each request's grammar saw exactly its output tokens
    for so in outs:
        sampling = {r for r in so.num_scheduled_tokens if r not in so.partial_req_ids}
        assert set(so.structured_output_req_ids) == sampling
