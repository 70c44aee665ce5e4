"""Structured-output throughput: the same workload with and without a JSON schema.

    python -m jaxengine.benchmarks.throughput --structured-outputs --num-prompts 64 \\
        --input-len 128 --output-len 128

One jaxengine engine serves the random-token prompts of `jaxengine.benchmarks.throughput` twice per
round, greedily for exactly ``output_len`` tokens: free (``ignore_eos``), then each
request under its own JSON schema (an array of at least 500 small objects, so no
output can close before ``output_len``; every token is constrained). Rounds
alternate the two so drift on a noisy machine hits both; the ratio is constrained
over free output tok/s per round, with the share of the constrained run's wall time
the scheduler spent filling bitmask rows on the host. Before that, every schema is
compiled once from cold (grammar text, validation, compile and the first mask: llguidance compiles
lazily, so the first mask is where the work is) and the median and p99 reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from jaxengine.benchmarks.common import describe_run, fmt, format_table, log, machine_info


def schema(i: int) -> dict[str, Any]:
    """Request i's schema: its own key names, so every request compiles its own."""
    item = {
        "type": "object",
        "properties": {
            f"id_{i}": {"type": "integer"},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": [f"id_{i}", "name", "kind", "ok"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": item, "minItems": 500}


def compile_times(llm: Any, schemas: list[dict]) -> list[float]:
    """Seconds from a schema to its first token mask, each from a cold cache."""
    from jaxengine.sampling_params import StructuredOutputsParams

    backend = llm.engine.structured_outputs.backend
    row = np.zeros((1, llm.engine.structured_outputs.width), np.int32)
    times = []
    for s in schemas:
        start = perf_counter()
        key = backend.grammar_key(StructuredOutputsParams(json=s))
        backend.validate(key)
        backend.fill_bitmasks([(backend.compile(key), 0)], row)
        times.append(perf_counter() - start)
    return times


def timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list]:
    requests = [{"prompt_token_ids": p} for p in prompts]
    start = perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    return perf_counter() - start, outputs


def run_structured(args: argparse.Namespace, files: Any, prompts: list[list[int]], command: str):
    from jaxengine import LLM, SamplingParams, StructuredOutputsParams

    n, out_len = len(prompts), args.output_len
    kwargs = {"max_model_len": max(map(len, prompts)) + out_len, **args.engine_kwargs}
    llm = LLM(model=files.name, **kwargs)
    schemas = [schema(i) for i in range(n)]
    compiles = compile_times(llm, schemas)
    free = [SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)] * n
    constrained = [
        SamplingParams(
            temperature=0, max_tokens=out_len, structured_outputs=StructuredOutputsParams(json=s)
        )
        for s in schemas
    ]
    log("warm-up: the whole batch, a few tokens, both ways")
    few = min(8, out_len)
    timed(llm, prompts, [SamplingParams(temperature=0, max_tokens=few, ignore_eos=True)] * n)
    timed(llm, prompts, [_shorter(p, few) for p in constrained])
    mask_time = _time_bitmasks(llm.engine.structured_outputs)
    rounds = []
    for r in range(args.rounds):
        t_free, _ = timed(llm, prompts, free)
        t_cons, outs = timed(llm, prompts, constrained)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == n * out_len, f"constrained outputs stopped early ({tokens} tokens)"
        assert all(o.outputs[0].text.startswith("[") for o in outs)
        rounds.append((n * out_len / t_free, tokens / t_cons, t_cons, sum(mask_time)))
        mask_time.clear()
        log(f"round {r}: free {rounds[-1][0]:.1f}, constrained {rounds[-1][1]:.1f} out tok/s")
    return report(args, command, compiles, rounds)


def _shorter(params: Any, max_tokens: int) -> Any:
    params = params.clone()
    params.max_tokens = max_tokens
    return params


def _time_bitmasks(manager: Any) -> list[float]:
    """Collects the seconds the scheduler spends filling bitmask rows."""
    spent: list[float] = []
    fill = manager.bitmask

    def timed_fill(requests, drafts=None):
        start = perf_counter()
        try:
            return fill(requests, drafts)
        finally:
            spent.append(perf_counter() - start)

    manager.bitmask = timed_fill
    return spent


def report(args, command: str, compiles: list[float], rounds: list[tuple]) -> int:
    ms = sorted(1000 * t for t in compiles)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    workload = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "engine_kwargs": args.engine_kwargs,
        "rounds": args.rounds,
    }
    print(describe_run("structured-output throughput", machine_info(), workload))
    rows = [
        [str(i), fmt(f, 1), fmt(c, 1), fmt(c / f, 3), fmt(100 * m / t, 1)]
        for i, (f, c, t, m) in enumerate(rounds)
    ]
    mean = statistics.mean(r[1] / r[0] for r in rounds)
    rows.append(["mean", "", "", fmt(mean, 3), ""])
    header = ["round", "free out tok/s", "json-schema out tok/s", "ratio", "% time in masks"]
    print(format_table(header, rows))
    print(
        f"schema compile (cold, to the first mask): median {statistics.median(ms):.2f} ms, "
        f"p99 {p99:.2f} ms over {len(ms)} schemas"
    )
    if args.json:
        doc = {"benchmark": "structured", "command": command, "machine": machine_info()}
        doc.update(workload=workload, rounds=rounds, ratio_mean=mean, compile_ms=ms)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
