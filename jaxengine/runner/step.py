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

from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.sampler import prompt_logprobs, sample
from jaxengine.runner.transfer import TreeSpec, pack_tree, unpack_tree

PROMPT_LOGPROBS_ROWS = 256  # rows of [rows, V] logits materialized at a time


def step_inputs(batch: PackedBatch) -> tuple[tuple, TreeSpec]:
    """The packed buffers and spec of a batch, as `make_step`'s function takes them."""
    md = AttentionMetadata(**batch.metadata_fields())
    return pack_tree((batch.token_ids, batch.positions, md, batch.logits_indices, batch.feed_rows))


def fed_token_ids(token_ids: jax.Array, feed_rows: jax.Array, fed_ids: jax.Array) -> jax.Array:
    """``token_ids[T]`` with each position whose ``feed_rows`` entry is >= 0 replaced by
    that row of ``fed_ids`` (the previous step's sampled ids, still on device)."""
    fed = fed_ids[jnp.maximum(feed_rows, 0)]
    return jnp.where(feed_rows >= 0, fed, token_ids)


def make_step(module: Any, logits_sharding: Any = None, with_logits: bool = True):
    """``step(params, kv_caches, buffers, fed_ids, images, spec)`` -> ``(logits[R, V],
    hidden[T, H], kv)``; without ``with_logits`` (a pooling model, which may have no
    LM head) the logits are None.

    ``buffers``/``spec`` pack ``(token_ids[T], positions[T], md, logits_indices[R],
    feed_rows[T])``; ``fed_ids[max_num_seqs]`` are the previous step's sampled ids
    (async scheduling: `fed_token_ids`). ``logits_sharding`` pins where the logits
    land (replicated over a tensor group, so the sampler's input layout never varies
    and every device can read the result). ``images`` (a vision-language model's,
    else None): the encoder's output rows (`runner.encoder`), which the batch's
    ``md.image_rows`` point into.
    """

    def step(params, kv_caches, buffers, fed_ids, images=None, spec=None):
        token_ids, positions, md, logits_indices, feed_rows = unpack_tree(buffers, spec)
        token_ids = fed_token_ids(token_ids, feed_rows, fed_ids)
        args = (token_ids, positions, kv_caches, md)
        if images is not None:
            args += (image_embeds(images, md),)
        hidden, kv_caches = module.apply({"params": params}, *args)
        if not with_logits:
            return None, hidden, kv_caches
        return logits_at(module, params, hidden, logits_indices, logits_sharding), hidden, kv_caches

    return jax.jit(step, donate_argnums=(1,), static_argnames=("spec",))


def image_embeds(images: jax.Array, md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """The forward's ``image_embeds`` of a step: each token's row of the encoder's
    output ``images`` and where one applies (``md.image_rows`` >= 0)."""
    return images[jnp.maximum(md.image_rows, 0)], md.image_rows >= 0


def logits_at(module: Any, params: Any, hidden: jax.Array, rows: jax.Array, sharding: Any):
    """The logits ``[R, V]`` of ``hidden``'s ``rows``, placed by ``sharding`` (None:
    where XLA leaves them)."""
    logits = module.apply({"params": params}, hidden[rows], method="compute_logits")
    if sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    return logits


def make_classifier(module: Any):
    """``classify(params, rows[R, H])`` -> ``[R, num_labels]``: a classification
    model's head (``module.classify``) on its pooled rows."""
    return jax.jit(lambda params, rows: module.apply({"params": params}, rows, method="classify"))


def make_kv_calibration(module: Any):
    """``fn(params, kv_caches, buffers, spec)`` -> the forward's ``kv_amax`` per
    attention layer (`layers.attention`; a tree of ``[2]`` arrays: largest |k|, |v|).
    The caches are not donated: the forward's writes are dropped."""

    def fn(params, kv_caches, buffers, spec):
        token_ids, positions, md, _, _ = unpack_tree(buffers, spec)
        _, state = module.apply(
            {"params": params}, token_ids, positions, kv_caches, md, mutable=["intermediates"]
        )
        return state["intermediates"]

    return jax.jit(fn, static_argnames=("spec",))


def make_sampler(num_slots: int, ids_sharding: Any = None, processors: tuple = ()):
    """``sampler(logits[R, V], buffers, spec, flags)`` -> `SamplerOutput` whose
    ``token_ids`` are padded to ``num_slots`` (the shape a next step's ``fed_ids``
    has, whatever R), placed by ``ids_sharding``. ``processors``: the engine's custom
    logits processors, traced into every variant (`jaxengine.logits_processor`)."""

    def run(logits, buffers, spec, flags):
        out = sample(logits, unpack_tree(buffers, spec), flags=flags, processors=processors)
        ids = jnp.zeros(num_slots, jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
        if ids_sharding is not None:
            ids = jax.lax.with_sharding_constraint(ids, ids_sharding)
        return out._replace(token_ids=ids)

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
    """``gather(kv_caches, ids[N]) -> pages`` and ``scatter(kv_caches, ids[N], pages)``,
    over the paged layers (a hybrid model's state pools, tuples, are left out:
    `runner.state_swap` moves those).

    Scatter drops ids past the cache's end, which is how padding ids are spelled.
    """

    def gather(kv_caches, ids):
        return tuple(cache[ids] for cache in kv_caches if not isinstance(cache, tuple))

    def scatter(kv_caches, ids, pages):
        it = iter(pages)
        return tuple(
            cache if isinstance(cache, tuple) else cache.at[ids].set(next(it), mode="drop")
            for cache in kv_caches
        )

    return jax.jit(gather), jax.jit(scatter, donate_argnums=(0,))
