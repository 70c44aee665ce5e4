"""Ahead-of-time compiled functions of a runner, keyed by bucket and variant.

`compile_all` compiles everything an engine can call: the model step and the
prompt-logprobs function of every bucket, the sampler variants of every request
count, and the page gather/scatter for swapping. With ``--enforce-eager`` nothing is
compiled up front; each function compiles on its first use (same code path).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxengine.models.metadata import AttentionMetadata
from jaxengine.runner.buckets import Bucket
from jaxengine.runner.sampler import sample_jit
from jaxengine.runner.sampling_metadata import (
    SamplerFlags,
    SamplingBatch,
    logprobs_bucket,
)
from jaxengine.runner.sampling_metadata import (
    bucket as width_bucket,
)
from jaxengine.runner.step import make_prompt_logprobs, make_step, make_swap_fns

logger = logging.getLogger(__name__)

BIAS_WIDTH = 1024  # logit_bias entries + banned tokens covered by the precompiled variant
ALLOWED_WIDTH = 1024  # allowed_token_ids covered by the precompiled variant


class CompiledFunctions:
    """Compiled executables of one runner; `compile_all` fills every slot."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        settings = runner.settings
        vocab = runner.vocab_size
        module = runner.loaded.module
        self._step_jit = make_step(module)
        self.logprobs_k = logprobs_bucket(settings.max_logprobs, vocab) or 0
        self._prompt_lp_jit = make_prompt_logprobs(module, self.logprobs_k)
        self._gather_jit, self._scatter_jit = make_swap_fns()
        self.sampler_variants = self._variants(vocab, settings)
        self._cache: dict[tuple, Any] = {}

    @staticmethod
    def _variants(vocab: int, settings: Any) -> list[SamplerFlags]:
        """Greedy; greedy with logprobs; temperature + filters; everything."""
        k = logprobs_bucket(settings.max_logprobs, vocab)
        mode = settings.logprobs_mode
        return [
            SamplerFlags(all_greedy=True, logprobs_mode=mode),
            SamplerFlags(all_greedy=True, num_logprobs=k, logprobs_mode=mode),
            SamplerFlags(filter_width=vocab, num_logprobs=k, logprobs_mode=mode),
            SamplerFlags(
                filter_width=vocab,
                penalty_width=width_bucket(settings.max_model_len, growth=2),
                bias_width=width_bucket(BIAS_WIDTH, cap=vocab),
                allowed_width=width_bucket(ALLOWED_WIDTH, cap=vocab),
                num_logprobs=k,
                logprobs_mode=mode,
            ),
        ]

    # ------------------------------------------------------------------ lookup

    def _get(self, key: tuple, build) -> Any:
        fn = self._cache.get(key)
        if fn is None:
            fn = self._cache[key] = build()
        return fn

    def step(self, bucket: Bucket):
        return self._get(("step", bucket), lambda: self._lower_step(bucket))

    def prompt_logprobs(self, bucket: Bucket):
        return self._get(("prompt_lp", bucket), lambda: self._lower_prompt_lp(bucket))

    def sampler(self, num_reqs: int, flags: SamplerFlags):
        return self._get(("sampler", num_reqs, flags), lambda: self._lower_sampler(num_reqs, flags))

    # ------------------------------------------------------------------ lowering

    def _lower_step(self, bucket: Bucket):
        r = self.runner
        t, n = bucket.num_tokens, bucket.num_reqs
        i32 = jnp.int32
        md = AttentionMetadata(
            seq_lens=jax.ShapeDtypeStruct((n,), i32),
            query_start_loc=jax.ShapeDtypeStruct((n + 1,), i32),
            page_table=jax.ShapeDtypeStruct((n, r.pages_per_req), i32),
            slot_mapping=jax.ShapeDtypeStruct((t,), i32),
            num_seqs=jax.ShapeDtypeStruct((), i32),
        )
        tokens = jax.ShapeDtypeStruct((t,), i32)
        args = (r.params, r.kv_caches, tokens, tokens, md, jax.ShapeDtypeStruct((n,), i32))
        return self._step_jit.lower(*args).compile()

    def _lower_prompt_lp(self, bucket: Bucket):
        r = self.runner
        hidden = jax.ShapeDtypeStruct(
            (bucket.num_tokens, r.loaded.config.hidden_size), r.loaded.config.dtype
        )
        targets = jax.ShapeDtypeStruct((bucket.num_tokens,), jnp.int32)
        return self._prompt_lp_jit.lower(r.params, hidden, targets).compile()

    def _lower_sampler(self, num_reqs: int, flags: SamplerFlags):
        vocab = self.runner.vocab_size
        md = SamplingBatch([], num_reqs, vocab).to_metadata(flags)
        md_spec = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), md)
        logits = jax.ShapeDtypeStruct((num_reqs, vocab), jnp.float32)
        return sample_jit.lower(logits, md_spec, flags=flags).compile()

    def _swap_ids(self, ids: list[int]) -> np.ndarray:
        size = self.runner.pages_per_req
        padded = -(-len(ids) // size) * size
        out = np.full(padded, self.runner.settings.num_blocks, np.int32)  # past the end
        out[: len(ids)] = ids
        return out

    def _gather_fn(self):
        ids = jax.ShapeDtypeStruct((self.runner.pages_per_req,), jnp.int32)
        return self._get(
            ("gather",), lambda: self._gather_jit.lower(self.runner.kv_caches, ids).compile()
        )

    def _scatter_fn(self):
        caches = self.runner.kv_caches
        ids = jax.ShapeDtypeStruct((self.runner.pages_per_req,), jnp.int32)
        pages = tuple(jax.ShapeDtypeStruct((ids.shape[0], *c.shape[1:]), c.dtype) for c in caches)
        return self._get(
            ("scatter",), lambda: self._scatter_jit.lower(caches, ids, pages).compile()
        )

    def gather_pages(self, kv_caches, ids: list[int]) -> list[np.ndarray]:
        """Device pages ``ids`` of every layer, as host arrays ``[len(ids), S, 2Hkv, D]``."""
        padded = self._swap_ids(ids)
        size = self.runner.pages_per_req
        fn = self._gather_fn()
        parts = [
            jax.device_get(fn(kv_caches, padded[i : i + size])) for i in range(0, len(padded), size)
        ]
        return [
            np.concatenate([p[layer] for p in parts])[: len(ids)] for layer in range(len(kv_caches))
        ]

    def scatter_pages(self, kv_caches, ids: list[int], pages: list[np.ndarray]):
        """Writes host ``pages`` (per layer) into device pages ``ids``; returns the caches."""
        padded = self._swap_ids(ids)
        size = self.runner.pages_per_req
        full = [np.zeros((len(padded), *p.shape[1:]), p.dtype) for p in pages]
        for f, p in zip(full, pages, strict=True):
            f[: len(ids)] = p
        fn = self._scatter_fn()
        for i in range(0, len(padded), size):
            kv_caches = fn(kv_caches, padded[i : i + size], tuple(f[i : i + size] for f in full))
        return kv_caches

    # ------------------------------------------------------------------ warm-up

    def compile_all(self, progress: bool = True) -> None:
        r = self.runner
        jobs = []
        for b in r.buckets.buckets:
            jobs.append(("step", lambda b=b: self.step(b)))
            jobs.append(("prompt logprobs", lambda b=b: self.prompt_logprobs(b)))
        for n in r.buckets.request_sizes:
            for flags in self.sampler_variants:
                jobs.append(("sampler", lambda n=n, f=flags: self.sampler(n, f)))
        if r.host_pages is not None:
            jobs.append(("swap", self._gather_fn))
            jobs.append(("swap", self._scatter_fn))
        bar = tqdm(jobs, desc="Compiling buckets", disable=not progress, unit="fn")
        for _, job in bar:
            job()
        logger.info(
            "compiled %d buckets %s (requests %s), %d sampler variants",
            len(r.buckets.buckets),
            r.buckets.token_buckets,
            r.buckets.request_sizes,
            len(self.sampler_variants),
        )
