"""The engine section's engines: one alive at a time, shared where the arguments match.

Every engine serves the same Llama-3-8B-shaped model (`bench.decode_roofline.
llama_config`: a config saved to a temporary folder, ``load_format="dummy"``, bf16,
``--layers N`` to cut it; a tiny Llama in the dry run). Two shapes of engine
(`profile.EngineShape`): ``small`` for the batch-1 and variant measurements and
``big`` for the throughput and TTFT ones. `EnginePool.get` returns the engine of a
name and its arguments, building it after shutting the previous one down (one 8B
engine's weights and KV cache at a time on the device), and keeps it while the next
measurement asks for the same arguments. All of them share one compilation cache
directory, empty when the section starts (so the first build is a cold start), so
programs that do not change between engines (the sampler's) compile once.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.device.profile import Profile


def model_folder(folder: str, profile: Profile, layers: int | None) -> dict[str, Any]:
    """Saves the model's config in ``folder``; returns its shape for the record."""
    from bench.decode_roofline import llama_config

    config = llama_config(layers, profile.small_model)
    config.save_pretrained(folder)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    keys += ("num_key_value_heads", "vocab_size")
    return {k: getattr(config, k) for k in keys}


def base_kwargs(folder: str, cache_dir: str, profile: Profile) -> dict[str, dict[str, Any]]:
    """The ``small`` and ``big`` engines' arguments."""
    common = {
        "model": folder,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "enable_prefix_caching": False,  # every repeat of a prompt is computed again
        "swap_space": 0,
        "compilation_cache_dir": cache_dir,
    }
    n, i, o = profile.throughput
    lora_len = profile.lora[3] + profile.lora[4]
    small_len = max(profile.prompt_len + profile.decode_tokens + 1, sum(profile.spec), lora_len)
    big_len = max(i + o, profile.ttft_len + 1)
    if profile.small == profile.big:  # one engine for both (the dry run)
        small_len = big_len = max(small_len, big_len)
    return {
        "small": {**common, "max_model_len": small_len + 16, **profile.small.kwargs()},
        "big": {**common, "max_model_len": big_len + 16, **profile.big.kwargs()},
    }


@contextlib.contextmanager
def compilation_cache_restored() -> Iterator[None]:
    """JAX's persistent-cache settings as they were before: engines point them at
    their ``compilation_cache_dir`` for the whole process (`runner.executables.
    use_compilation_cache_dir`), here a temporary directory that ends with the
    section; the later sections' programs must not be written there."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


class EnginePool:
    """Builds engines on demand, one alive at a time; counts each one's compilations
    after warm-up when it is shut down."""

    def __init__(self) -> None:
        self.current: tuple[str, str, Any] | None = None  # (arguments key, name, LLM)
        self.compiles: dict[str, int | None] = {}
        self.build_seconds: dict[str, float] = {}

    def get(self, name: str, kwargs: dict[str, Any]) -> Any:
        """The engine of ``kwargs`` (the current one when they match)."""
        key = json.dumps(kwargs, sort_keys=True)
        if self.current is not None and self.current[0] == key:
            return self.current[2]
        self.close()
        llm, seconds = build(kwargs)
        self.build_seconds[name] = seconds
        self.current = (key, name, llm)
        return llm

    def close(self) -> None:
        if self.current is None:
            return
        _, name, llm = self.current
        self.current = None
        eager = llm.engine.config.model_config.enforce_eager
        self.compiles[name] = None if eager else llm.engine.executor.compiles_after_warmup
        llm.shutdown()


def build(kwargs: dict[str, Any]) -> tuple[Any, float]:
    """An `LLM` of ``kwargs`` and the seconds its construction took (load, KV cache,
    and the warm-up's compilations unless ``enforce_eager``)."""
    from jaxengine import LLM

    start = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - start


def weight_bytes(llm: Any) -> int:
    from sharding.memory import total_bytes

    return total_bytes(llm.engine.executor.runner.params)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Fresh prompts of random ordinary ids (0 left out)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(count)]


def repetitive_prompt(length: int, period: int = 16) -> list[int]:
    """A prompt repeating ``period`` ids: where n-gram proposals can pay."""
    return [10 + i % period for i in range(length)]


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int, loras=None) -> float:
    """Seconds of one greedy ``generate`` of ``max_tokens`` each (EOS ignored)."""
    from jaxengine import SamplingParams
    from jaxengine.benchmarks.lora import timed

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return timed(llm, prompts, params, loras)
