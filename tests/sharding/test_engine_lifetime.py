"""An engine's lifetime is explicit: engine after engine in one process.

The notebook pattern: build an `LLM`, try it, shut it down, build another with a
different layout. Each shutdown must give back every device buffer it held, and no
engine's compile guard may hear another engine's compilations.
"""

from __future__ import annotations

import gc
import logging

import jax

from jaxengine import LLM
from tests.sharding.engine_checks import build, greedy

LAYOUTS = [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]


def live_device_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_three_engines_one_after_another(llama_dir, caplog):
    baseline = live_device_bytes()
    outputs = []
    with caplog.at_level(logging.WARNING, logger="jaxengine.runner.compile_guard"):
        for layout in LAYOUTS:
            with build(llama_dir, **layout) as llm:
                outputs.append(greedy(llm))
                assert llm.engine.executor.compiles_after_warmup == 0
                assert live_device_bytes() > baseline
            assert live_device_bytes() == baseline, f"{layout} left device buffers behind"
    assert not [r for r in caplog.records if "after warm-up" in r.getMessage()]
    assert outputs[0] == outputs[1] == outputs[2]  # the layouts agree


def test_garbage_collection_shuts_the_engine_down(llama_dir):
    baseline = live_device_bytes()
    llm = build(llama_dir)
    executor = llm.engine.executor
    del llm
    assert live_device_bytes() == baseline
    assert executor.runner.params is None


def test_a_shut_down_llm_refuses_to_generate(llama_dir):
    llm: LLM = build(llama_dir)
    llm.shutdown()
    llm.shutdown()  # idempotent
    try:
        greedy(llm)
    except RuntimeError as e:
        assert "shut down" in str(e)
    else:
        raise AssertionError("generate ran on a shut-down engine")
