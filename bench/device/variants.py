"""The engine section's variants, each against the base engine of the same run.

- ``sync``: ``async_scheduling=False``, batch-1 decode tok/s over the base's (the
  base schedules asynchronously on a GPU, the default there; synchronously on CPU);
- ``fp8_weights`` / ``int8_weights``: ``quantization="fp8"`` / ``"int8"``, batch-1
  decode tok/s (and MBU at the quantized weights' bytes) over bf16's;
- ``fp8_kv_cache``: ``kv_cache_dtype="fp8"``, batch-1 decode tok/s over the base's;
- ``ngram``: n-gram speculation (k = 4, lookup 2-4) at batch 1 on a repetitive
  prompt, output tok/s over the base's on the same prompt, the acceptance rate and
  the mean acceptance length from the engine's counters, and whether the greedy
  tokens are the base's;
- ``lora``: ``enable_lora`` with four random adapters
  (`jaxengine.benchmarks.lora.write_adapters`) on every projection, the batch's
  requests round-robin over them, output tok/s over the base's without adapters.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.device.engines import random_prompts, repetitive_prompt, timed_generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip


def _ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def decode_variant(run: Any, name: str, **overrides: Any) -> dict[str, Any]:
    out = run.decode(run.small(name, **overrides))
    out["over_base"] = _ratio(out["tok_s"], run.base.get("decode_tok_s"))
    return out


def sync_scheduling(run: Any) -> dict[str, Any]:
    return decode_variant(run, "sync", async_scheduling=False)


def fp8_weights(run: Any) -> dict[str, Any]:
    return decode_variant(run, "fp8_weights", quantization="fp8")


def int8_weights(run: Any) -> dict[str, Any]:
    return decode_variant(run, "int8_weights", quantization="int8")


def fp8_kv_cache(run: Any) -> dict[str, Any]:
    return decode_variant(run, "fp8_kv_cache", kv_cache_dtype="fp8")


def ngram(run: Any) -> dict[str, Any]:
    from bench.spec_decode import timed
    from jaxengine import SamplingParams

    llm = run.small("ngram", speculative_config=NGRAM)
    prompt_len, tokens = run.profile.spec
    prompts = [repetitive_prompt(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tok_s, outputs, (drafts, drafted, accepted) = timed(llm, prompts, params)
    return {
        "tok_s": tok_s,
        "over_none": _ratio(tok_s, run.base.get("ngram_none_tok_s")),
        "acceptance": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "same_tokens_as_none": outputs == run.base.get("ngram_none_tokens"),
    }


def lora(run: Any) -> dict[str, Any]:
    from jaxengine import LoRARequest
    from jaxengine.benchmarks.lora import write_adapters
    from jaxengine.models.layers.lora import target_shapes

    n, rank, count, i, o = run.profile.lora
    llm = run.small("lora", enable_lora=True, max_loras=n, max_lora_rank=rank)
    prompts = random_prompts(count, i, run.model["vocab_size"], seed=2)
    with tempfile.TemporaryDirectory(prefix="device-lora-") as root:
        shapes = target_shapes(llm.engine.model_config)
        folders = write_adapters(Path(root), shapes, n, rank, seed=0)
        requests = [LoRARequest(f"adapter{k}", k + 1, str(f)) for k, f in enumerate(folders)]
        loras = [requests[k % n] for k in range(count)]
        timed_generate(llm, prompts, 2, loras)  # warm-up: the adapters loaded
        tok_s = count * o / timed_generate(llm, prompts, o, loras)
    return {
        "adapters": n,
        "rank": rank,
        "prompts": count,
        "tok_s": tok_s,
        "over_base": _ratio(tok_s, run.base.get("lora_none_tok_s")),
    }


ITEMS = (
    ("sync", sync_scheduling),
    ("fp8_weights", fp8_weights),
    ("int8_weights", int8_weights),
    ("fp8_kv_cache", fp8_kv_cache),
    ("ngram", ngram),
    ("lora", lora),
)
