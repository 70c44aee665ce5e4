"""The compiled functions of a runner and their warm-up.

`compile_all` runs every function the engine can call once, on padding inputs of
every shape it can see: the model step and prompt-logprobs function of each bucket,
each sampler variant at each request count, and the page gather/scatter of swapping.
Running (rather than only lowering) fills jit's own cache, so later steps take its
fast C++ dispatch path. With ``--enforce-eager`` nothing runs up front; each shape
compiles on first use.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxengine.runner.batch import pack_batch
from jaxengine.runner.buckets import Bucket
from jaxengine.runner.sampling_metadata import (
    SamplerFlags,
    SamplingBatch,
    logprobs_bucket,
)
from jaxengine.runner.sampling_metadata import (
    bucket as width_bucket,
)
from jaxengine.runner.step import (
    make_prompt_logprobs,
    make_sampler,
    make_step,
    make_swap_fns,
    step_inputs,
)
from jaxengine.runner.transfer import pack_tree

logger = logging.getLogger(__name__)

BIAS_WIDTH = 1024  # logit_bias entries + banned tokens covered by the precompiled variant
ALLOWED_WIDTH = 1024  # allowed_token_ids covered by the precompiled variant


class CompiledFunctions:
    """The jitted functions of one runner, called with packed per-step inputs."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        settings = runner.settings
        vocab = runner.vocab_size
        module = runner.loaded.module
        plan = runner.plan
        self.logits_sharding = plan.replicated if plan is not None else None
        self._step = make_step(module, self.logits_sharding)
        self._sampler = make_sampler()
        self.logprobs_k = logprobs_bucket(settings.max_logprobs, vocab) or 0
        self._prompt_lp = make_prompt_logprobs(module, self.logprobs_k)
        self._gather, self._scatter = make_swap_fns()
        self.sampler_variants = self._variants(vocab, settings)

    @staticmethod
    def _variants(vocab: int, settings: Any) -> list[SamplerFlags]:
        """Greedy; greedy with logprobs; temperature + filters; everything; and each
        again with the structured-output bitmask (a batch mixing constrained and free
        requests runs one of those and compiles nothing)."""
        k = logprobs_bucket(settings.max_logprobs, vocab)
        mode = settings.logprobs_mode
        base = [
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
        return base + [dataclasses.replace(f, token_bitmask=True) for f in base]

    # ------------------------------------------------------------------ calls

    def step(self, params, kv_caches, batch):
        """Forward of a packed batch -> ``(logits[R, V], hidden[T, H], kv_caches)``."""
        buffers, spec = step_inputs(batch)
        return self._step(params, kv_caches, buffers, spec=spec)

    def to_device(self, logits: np.ndarray):
        """Host logits placed as the step leaves them (the logits-processor path)."""
        if self.logits_sharding is None:
            return jnp.asarray(logits)
        return jax.device_put(logits, self.logits_sharding)

    def sample(self, logits, metadata, flags: SamplerFlags):
        buffers, spec = pack_tree(metadata)
        return self._sampler(logits, buffers, spec=spec, flags=flags)

    def prompt_logprobs(self, params, hidden, targets: np.ndarray):
        return self._prompt_lp(params, hidden, targets)

    def _swap_ids(self, ids: list[int]) -> np.ndarray:
        size = self.runner.pages_per_req
        padded = max(-(-len(ids) // size), 1) * size
        out = np.full(padded, self.runner.settings.num_blocks, np.int32)  # past the end
        out[: len(ids)] = ids
        return out

    def gather_pages(self, kv_caches, ids: list[int]) -> list[np.ndarray]:
        """Device pages ``ids`` of every layer, as host arrays ``[len(ids), S, 2Hkv, D]``."""
        padded, size = self._swap_ids(ids), self.runner.pages_per_req
        parts = [
            jax.device_get(self._gather(kv_caches, padded[i : i + size]))
            for i in range(0, len(padded), size)
        ]
        return [
            np.concatenate([p[layer] for p in parts])[: len(ids)] for layer in range(len(kv_caches))
        ]

    def scatter_pages(self, kv_caches, ids: list[int], pages: list[np.ndarray]):
        """Writes host ``pages`` (per layer) into device pages ``ids``; returns the caches."""
        padded, size = self._swap_ids(ids), self.runner.pages_per_req
        full = []
        for p in pages:
            f = np.zeros((len(padded), *p.shape[1:]), p.dtype)
            f[: len(ids)] = p
            full.append(f)
        for i in range(0, len(padded), size):
            kv_caches = self._scatter(
                kv_caches, padded[i : i + size], tuple(f[i : i + size] for f in full)
            )
        return kv_caches

    # ------------------------------------------------------------------ warm-up

    def _warm_bucket(self, bucket: Bucket) -> None:
        r = self.runner
        batch = pack_batch(
            [],
            page_size=r.settings.block_size,
            num_tokens=bucket.num_tokens,
            num_reqs=bucket.num_reqs,
            pages_per_req=r.pages_per_req,
        )
        _, hidden, r.kv_caches = self.step(r.params, r.kv_caches, batch)
        targets = np.zeros(bucket.num_tokens, np.int32)
        jax.block_until_ready(self.prompt_logprobs(r.params, hidden, targets))

    def _warm_sampler(self, num_reqs: int, flags: SamplerFlags) -> None:
        metadata = SamplingBatch([], num_reqs, self.runner.vocab_size).to_metadata(flags)
        logits = self.to_device(np.zeros((num_reqs, self.runner.vocab_size), np.float32))
        jax.block_until_ready(self.sample(logits, metadata, flags))

    def _warm_swap(self) -> None:
        r = self.runner
        empty = [np.zeros((0, *h.shape[1:]), h.dtype) for h in r.host_pages]
        self.gather_pages(r.kv_caches, [])
        r.kv_caches = self.scatter_pages(r.kv_caches, [], empty)

    def compile_all(self, progress: bool = True) -> None:
        r = self.runner
        jobs = [lambda b=b: self._warm_bucket(b) for b in r.buckets.buckets]
        jobs += [
            lambda n=n, f=f: self._warm_sampler(n, f)
            for n in r.buckets.request_sizes
            for f in self.sampler_variants
        ]
        if r.host_pages is not None:
            jobs.append(self._warm_swap)
        for job in tqdm(jobs, desc="Compiling buckets", disable=not progress, unit="fn"):
            job()
        logger.info(
            "compiled %d buckets %s (requests %s), %d sampler variants",
            len(r.buckets.buckets),
            r.buckets.token_buckets,
            r.buckets.request_sizes,
            len(self.sampler_variants),
        )
