"""The engine section: a Llama-3-8B-shaped model served end to end.

Items, in order (each engine built once, `engines.EnginePool`):

- ``startup``: the ``small`` engine built on the empty compilation cache directory
  (cold: every bucket and sampler variant compiled), shut down, and built again on
  the same directory (warm: the stored executables loaded). The warm one stays as
  the base engine.
- ``decode``: batch-1 decode tok/s (`bench.decode_roofline.decode_rate`: two
  generations that differ only in length) and MBU = weight bytes x tok/s / bandwidth,
  against three bandwidths: the sheet's (``mbu_sheet``; None off the table), the
  read probe's (``mbu_read_probe``: what a decode's weight reads can reach; the goal,
  >= 0.85) and the copy probe's (``mbu_copy_probe``).
- ``trace``: `bench.device.traced`: one prefill step and a few batch-1 decode steps
  of the base engine under `jax.profiler`, read into a table (busy fraction, top
  kernels, host gaps between steps) by `bench.device.trace`.
- ``baselines``: on the base engine, the n-gram workload without speculation and the
  LoRA workload without adapters (the ``ngram`` and ``lora`` items divide by them).
- ``throughput``: offline, N prompts x I in / O out in one ``generate`` (``big``
  engine), after a 4-prompt warm-up; ``ttft``: a fresh prompt of ``ttft_len`` tokens
  to its first token, median of 3, and its MFU (`prefill_flops` over the time) against
  the sheet's bf16 peak (``mfu_sheet``) and the run's matmul probe
  (``mfu_matmul_probe``).
- `bench.device.variants`: ``sync``, ``fp8_weights``, ``int8_weights``,
  ``fp8_kv_cache``, ``ngram``, ``lora``.
- ``compiles_after_warmup``: every engine's count (must be 0; None for an engine
  that skipped its warm-up), taken as each engine is shut down; ``build_seconds``.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from bench.device import traced, variants
from bench.device.engines import (
    EnginePool,
    base_kwargs,
    build,
    model_folder,
    random_prompts,
    repetitive_prompt,
    timed_generate,
    weight_bytes,
)
from bench.device.profile import Profile

BANDWIDTHS = {"sheet": "sheet_gb_s", "read_probe": "read_gb_s", "copy_probe": "copy_gb_s"}
MATMUL_RATES = {"sheet": "sheet_bf16_tflop_s", "matmul_probe": "matmul_tflop_s"}


def prefill_flops(model: dict[str, Any], length: int) -> float:
    """A fresh prompt's FLOPs: every layer's projections for each token, and causal
    attention (QK^T and PV over half the square); the logits of the last token only."""
    from bench.compute_ceiling import flops_per_token

    attention = 2 * 2 * model["num_hidden_layers"] * model["hidden_size"] * length * length / 2
    return (
        flops_per_token(model) * length + attention + 2 * model["hidden_size"] * model["vocab_size"]
    )


class EngineRun:
    """What the items share: the profile, the engines' arguments, the pool, the
    denominators and the results the later items compare with."""

    def __init__(self, profile: Profile, folder: str, cache_dir: str, layers: int | None) -> None:
        self.profile = profile
        self.model = model_folder(folder, profile, layers)
        self.kwargs = base_kwargs(folder, cache_dir, profile)
        self.pool = EnginePool()
        self.denominators: dict[str, float] = {}
        self.base: dict[str, Any] = {}  # decode tok/s, n-gram and LoRA baselines

    def small(self, name: str, **overrides: Any) -> Any:
        """The ``small`` engine with ``overrides`` (a variant: eager in the dry run)."""
        extra = {"enforce_eager": True} if overrides and self.profile.eager_variants else {}
        return self.pool.get(name, {**self.kwargs["small"], **overrides, **extra})

    def decode(self, llm: Any) -> dict[str, Any]:
        """Batch-1 decode tok/s and MBU of ``llm``."""
        from bench.decode_roofline import decode_rate

        p = self.profile
        rate = decode_rate(llm, p.prompt_len, p.decode_tokens, p.repeats)
        weights = weight_bytes(llm)
        out = {"tok_s": rate, "ms_per_token": 1000 / rate, "weight_gib": weights / 2**30}
        return {**out, **self.fractions("mbu", weights * rate / 1e9, BANDWIDTHS)}

    def fractions(self, prefix: str, rate: float, names: dict[str, str]) -> dict[str, Any]:
        """``rate`` over each denominator of ``names`` (suffix -> key): None where the
        run has no such denominator (the sheet on a CPU, a failed probe)."""
        found = {n: self.denominators.get(key) for n, key in names.items()}
        return {f"{prefix}_{n}": rate / d if d else None for n, d in found.items()}


def startup(run: EngineRun) -> dict[str, Any]:
    run.pool.close()  # nothing else on the device while the cold engine builds
    cold, cold_s = build(run.kwargs["small"])
    cold.shutdown()
    del cold
    run.small("base")
    return {"cold_s": cold_s, "warm_s": run.pool.build_seconds["base"]}


def decode(run: EngineRun) -> dict[str, Any]:
    out = run.decode(run.small("base"))
    run.base["decode_tok_s"] = out["tok_s"]
    return {**out, "goal_mbu": 0.85}


def baselines(run: EngineRun) -> dict[str, Any]:
    from bench.spec_decode import timed
    from jaxengine import SamplingParams

    llm = run.small("base")
    prompt_len, tokens = run.profile.spec
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    tok_s, outputs, _ = timed(llm, [repetitive_prompt(prompt_len)], params)
    run.base.update(ngram_none_tok_s=tok_s, ngram_none_tokens=outputs)
    n, rank, count, i, o = run.profile.lora
    prompts = random_prompts(count, i, run.model["vocab_size"], seed=2)
    timed_generate(llm, prompts, 2)  # warm-up
    run.base["lora_none_tok_s"] = count * o / timed_generate(llm, prompts, o)
    return {k: v for k, v in run.base.items() if k.endswith("tok_s")}


def throughput(run: EngineRun) -> dict[str, Any]:
    llm = run.pool.get("big", run.kwargs["big"])
    n, i, o = run.profile.throughput
    vocab = run.model["vocab_size"]
    timed_generate(llm, random_prompts(4, i, vocab, seed=3), 4)  # warm-up
    seconds = timed_generate(llm, random_prompts(n, i, vocab, seed=4), o)
    return {
        "prompts": n,
        "input_len": i,
        "output_len": o,
        "seconds": seconds,
        "out_tok_s": n * o / seconds,
        "total_tok_s": n * (i + o) / seconds,
        "req_s": n / seconds,
    }


def ttft(run: EngineRun) -> dict[str, Any]:
    llm = run.pool.get("big", run.kwargs["big"])
    length, vocab = run.profile.ttft_len, run.model["vocab_size"]
    prompts = random_prompts(4, length, vocab, seed=5)  # fresh: nothing cached
    timed_generate(llm, prompts[:1], 1)  # warm-up
    times = [timed_generate(llm, [p], 1) for p in prompts[1:]]
    median = statistics.median(times)
    tflop_s = prefill_flops(run.model, length) / median / 1e12
    out = {"prompt_len": length, "ttft_s": median, "prefill_tok_s": length / median}
    return {**out, "tflop_s": tflop_s, **run.fractions("mfu", tflop_s, MATMUL_RATES)}


def trace(run: EngineRun) -> dict[str, Any]:
    return traced.record(run.small("base"), run.profile)


def compiles(pool: EnginePool) -> dict[str, Any]:
    """Every engine's compilations after warm-up (the last engine shut down first)."""
    pool.close()
    counted = [c for c in pool.compiles.values() if c is not None]
    return {"per_engine": dict(pool.compiles), "total": sum(counted), "ok": sum(counted) == 0}


ITEMS = (
    ("startup", startup),
    ("decode", decode),
    ("trace", trace),
    ("baselines", baselines),
    ("throughput", throughput),
    ("ttft", ttft),
    *variants.ITEMS,
)


def run(section: Any, profile: Profile, denominators: dict[str, float], layers: int | None):
    with tempfile.TemporaryDirectory(prefix="device-engine-") as tmp:
        state = EngineRun(profile, f"{tmp}/model", f"{tmp}/xla", layers)
        state.denominators = denominators
        section.results["model"] = state.model
        section.results["engine_kwargs"] = state.kwargs
        try:
            for name, fn in ITEMS:
                section.item(name, lambda fn=fn: fn(state))
        finally:  # outside the budget: the counts are what the section is for
            section.results["compiles_after_warmup"] = compiles(state.pool)
            section.results["build_seconds"] = state.pool.build_seconds
            section.recorder.save()
