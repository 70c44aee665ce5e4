"""`bench.device.trace`: a trace recorded here (a tiny jitted function, three annotated
steps) read into the table, and the interval arithmetic on hand-made events."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench.device import trace
from bench.device.trace import Event


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x) @ x.T))
    x = jnp.ones((128, 128), jnp.float32)
    f(x).block_until_ready()  # compiled outside the trace
    with jax.profiler.trace(str(folder)):
        for i in range(3):
            with jax.profiler.TraceAnnotation(f"step {i}"):
                f(x).block_until_ready()
    return trace.load(folder)


def test_a_recorded_trace_reads_into_steps_and_kernels(recorded):
    result = trace.summarize(recorded, "step ", top=5, phases={"first": slice(0, 1),
                                                               "rest": slice(1, None)})  # fmt: skip
    backend = jax.default_backend()
    assert ("CPU executor" in result["plane"]) == (backend == "cpu")
    assert [s["step"] for s in result["steps"]] == ["step 0", "step 1", "step 2"]
    assert all(s["events"] > 0 and s["device_busy_ms"] > 0 for s in result["steps"])
    assert result["steps"][0]["gap_before_ms"] is None
    assert all(s["gap_before_ms"] is not None for s in result["steps"][1:])
    assert 0 < result["busy_fraction"] <= 1
    assert result["host_gap_ms"]["max"] >= result["host_gap_ms"]["median"]
    kernels = result["top_kernels"]
    assert kernels and all(k["count"] >= 3 for k in kernels[:1])
    totals = [k["total_ms"] for k in kernels]
    assert totals == sorted(totals, reverse=True)
    assert result["first"]["steps_read"] == 1 and result["rest"]["steps_read"] == 2
    text = trace.table(result)
    assert "plane read:" in text and "top kernels (window)" in text


def test_without_annotations_the_window_is_one_step(recorded):
    result = trace.summarize(recorded)
    assert [s["step"] for s in result["steps"]] == ["window"]
    assert result["host_gap_ms"] is None and result["device_busy_ms"] > 0


def test_busy_time_is_the_union_and_gaps_run_from_one_step_to_the_next():
    events = [Event("a", 0, 10), Event("b", 5, 15), Event("a", 30, 40, bytes=100)]
    assert trace.busy_ns(events) == 25
    split = trace.split_steps(events, [("s0", 0, 20), ("s1", 25, 45)])
    rows = trace.step_rows(split)
    assert [r["events"] for r in rows] == [2, 1]
    assert rows[1]["gap_before_ms"] == pytest.approx(15 / 1e6)
    top = trace.top_kernels(events, 1)
    assert top == [{"name": "a", "count": 2, "total_ms": 20 / 1e6, "bytes": 100, "gb_s": 5.0}]


def test_copy_sizes_are_read_from_the_details():
    assert trace._bytes({"memcpy_details": "kind_src:device size:4096 dest:0"}) == 4096
    assert trace._bytes({"bytes_accessed": 12}) == 12 and trace._bytes({}) is None
