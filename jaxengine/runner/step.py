"""The jitted device functions of one engine: the model step, sampling, prompt
logprobs and page swaps.

Each is a pure function of arrays. Per-step inputs arrive packed (`runner.transfer`)
with their `TreeSpec` as a static argument, so each bucket is one cache entry of the
jitted function and the C++ dispatch path stays fast. The KV caches are donated: XLA
updates them in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.metadata import AttentionMetadata
from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.sampler import prompt_logprobs, sample
from jaxengine.runner.transfer import TreeSpec, pack_tree, unpack_tree

PROMPT_LOGPROBS_ROWS = 256  # rows of [rows, V] logits materialized at a time


def step_inputs(batch: PackedBatch) -> tuple[tuple, TreeSpec]:
    """The packed buffers and spec of a batch, as `make_step`'s function takes them."""
    md = AttentionMetadata(**batch.metadata_fields())
    return pack_tree((batch.token_ids, batch.positions, md, batch.logits_indices))


def make_step(module: Any, logits_sharding: Any = None):
    """``step(params, kv_caches, buffers, spec)`` -> ``(logits[R, V], hidden[T, H], kv)``.

    ``buffers``/``spec`` pack ``(token_ids[T], positions[T], md, logits_indices[R])``.
    ``logits_sharding`` pins where the logits land (replicated over a tensor group,
    so the sampler's input layout never varies and every device can read the result).
    """

    def step(params, kv_caches, buffers, spec):
        token_ids, positions, md, logits_indices = unpack_tree(buffers, spec)
        hidden, kv_caches = module.apply({"params": params}, token_ids, positions, kv_caches, md)
        logits = module.apply({"params": params}, hidden[logits_indices], method="compute_logits")
        if logits_sharding is not None:
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        return logits, hidden, kv_caches

    return jax.jit(step, donate_argnums=(1,), static_argnames=("spec",))


def make_sampler():
    """``sampler(logits[R, V], buffers, spec, flags)`` -> `SamplerOutput`."""

    def run(logits, buffers, spec, flags):
        return sample(logits, unpack_tree(buffers, spec), flags=flags)

    return jax.jit(run, static_argnames=("spec", "flags"))


def make_prompt_logprobs(module: Any, k: int):
    """``fn(params, hidden[T, H], targets[T])`` -> `LogprobsOutput` with top ``k``.

    Logits are computed ``PROMPT_LOGPROBS_ROWS`` rows at a time so a long prefill
    chunk never materializes ``[T, V]`` at once.
    """

    def fn(params, hidden, targets):
        num_tokens = hidden.shape[0]
        rows = min(num_tokens, PROMPT_LOGPROBS_ROWS)
        pad = (-num_tokens) % rows
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))

        def one(chunk):
            h, t = chunk
            logits = module.apply({"params": params}, h, method="compute_logits")
            return prompt_logprobs(logits, jnp.maximum(t, 0), k)

        out = jax.lax.map(
            one, (hidden.reshape(-1, rows, hidden.shape[1]), targets.reshape(-1, rows))
        )
        return jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:])[:num_tokens], out)

    return jax.jit(fn)


def make_swap_fns():
    """``gather(kv_caches, ids[N]) -> pages`` and ``scatter(kv_caches, ids[N], pages)``.

    Scatter drops ids past the cache's end, which is how padding ids are spelled.
    """

    def gather(kv_caches, ids):
        return tuple(cache[ids] for cache in kv_caches)

    def scatter(kv_caches, ids, pages):
        return tuple(
            cache.at[ids].set(page, mode="drop")
            for cache, page in zip(kv_caches, pages, strict=True)
        )

    return jax.jit(gather), jax.jit(scatter, donate_argnums=(0,))
