"""The engine section's ``trace`` item: the base engine's steps under `jax.profiler`.

One fresh prompt of ``prompt_len`` tokens is added to the engine (batch 1, greedy,
EOS ignored) and the engine is stepped by hand, each `LLMEngine.step` inside a
`jax.profiler.TraceAnnotation` named ``device-step N``: step 0 is the prefill, the
next ``trace_decode_steps`` are decodes. The engine is warm (the same buckets
already compiled), so the trace holds execution only; the trace leaves out Python's
function calls (``python_tracer_level=0``: they would slow the host between steps and
widen the gaps it measures) and the programs' HLO. `bench.device.trace` reads it
into the table: the plane read, device busy fraction, top kernels, host gaps, per
phase (``prefill``, ``decode``). The trace itself is not kept (it is a temporary
folder); its size is recorded. With async scheduling (the default on a GPU) a step's
call dispatches the next step and returns the previous one's outputs, so a step's
device work runs partly inside the next annotation and the run ends with one more
call: the window's busy fraction and host gaps are what to read, the split between
the phases is shifted by up to one step (``async_scheduling`` is recorded).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.device import trace
from bench.device.profile import Profile

PREFIX = "device-step "
TOP = 12


def step_through(llm: Any, prompt: list[int], decode_steps: int) -> int:
    """Runs one request to its end a step at a time, each step annotated; returns
    the number of steps."""
    import jax

    from jaxengine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1 + decode_steps, ignore_eos=True)
    request_id = f"device-trace-{time.monotonic_ns()}"
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        with jax.profiler.TraceAnnotation(f"{PREFIX}{steps}"):
            engine.step()
        steps += 1
    return steps


def record(llm: Any, profile: Profile) -> dict[str, Any]:
    """Traces a prefill and ``trace_decode_steps`` decodes of ``llm``; the table."""
    import jax

    prompt = [3 + i % 200 for i in range(profile.prompt_len)]
    step_through(llm, prompt, 1)  # the same path once untraced: lazy work out of the way
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no per-call Python events: they would widen the gaps
    options.enable_hlo_proto = False  # the table needs none of the programs' HLO
    with tempfile.TemporaryDirectory(prefix="device-trace-") as folder:
        with jax.profiler.trace(folder, profiler_options=options):
            steps = step_through(llm, prompt, profile.trace_decode_steps)
        size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        data = trace.load(folder)
    phases = {"prefill": slice(0, 1), "decode": slice(1, None)}
    result = trace.summarize(data, PREFIX, TOP, phases)
    scheduling = llm.engine.config.scheduler_config.async_scheduling
    return {"engine_steps": steps, "trace_mib": size / 2**20,
            "async_scheduling": bool(scheduling), **result}  # fmt: skip
