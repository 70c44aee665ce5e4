"""Attention and the KV-cache write run per tensor shard under `shard_map`.

Inside, a kernel sees plain per-device arrays: its query heads ``[T, Hq/tp, D]`` and
its slice of the cache ``[P, S, 2 * Hkv/tp, D]``, so the reference, the Mosaic and the
Triton kernels run unchanged, with no collective. Page tables and the other metadata
are replicated; attention sinks (``sinks [Hq]``, gpt-oss) split with the query heads.

With fewer KV heads than tensor devices the projections produce every KV head on
every device (their weights are replicated) and each device keeps the one head its
query heads read: device ``i`` holds KV head ``i // (tp / Hkv)`` in its one-head slice
of the cache.

On TPU each device's slice of the cache may hold more rows than its heads' K and V
(padded to a multiple of 8, `jaxengine.models.layers.attention.kv_cache_shape`):
`with_real_heads` tells the attention function how many heads the first rows hold
(``num_kv_heads``), at any tensor size; the writes fill the padding with zeros.

A hybrid model's gated delta rule (``gated_delta_fn``, `layers.gated_delta`) runs per
shard too, on its heads' slice: q and k ``[T, Hk/tp, Dk]``, v ``[T, Hv/tp, Dv]``, g and
beta ``[T, Hv/tp]``, its slice of the state pool ``[S, Hv/tp, Dk, Dv]`` (updated in
place by the rows each request names; the rows and ``fresh`` replicated). A value
head reads key head ``h // (Hv / Hk)``, so contiguous slices keep each value head
with its key head.
With key heads that do not divide by ``tp`` it runs replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

HEADS = P(None, "tensor", None)  # [T, H, D]
CACHE = P(None, None, "tensor", None)  # [pages, page_size, 2 * H, D]
SINKS = P("tensor")  # [Hq]: attention sinks, as the query heads
META = P()


def shard_attention_fns(attention_kwargs: dict, mesh: Mesh, num_kv_heads: int) -> dict:
    """``attention_kwargs`` with ``attention_fn`` and ``update_fn`` run per shard."""
    attention_fn = attention_kwargs["attention_fn"]
    update_fn = attention_kwargs["update_fn"]
    tp = mesh.shape["tensor"]
    replicas = tp // num_kv_heads if num_kv_heads < tp else 1

    def local_update(cache, k, v, slot_mapping):
        if replicas > 1:  # k, v hold every KV head: keep this device's
            head = jax.lax.axis_index("tensor") // replicas
            k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
            v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
        return update_fn(cache, k, v, slot_mapping)

    kv_spec = P() if replicas > 1 else HEADS
    update = jax.shard_map(
        local_update,
        mesh=mesh,
        in_specs=(CACHE, kv_spec, kv_spec, META),
        out_specs=CACHE,
        check_vma=False,
    )

    def attention(q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, **kwargs):
        sinks = kwargs.pop("sinks", None)  # [Hq]: split with the query heads

        def local(q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, sinks):
            extra = {} if sinks is None else {"sinks": sinks}
            return attention_fn(
                q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, **kwargs, **extra
            )

        sinks_spec = None if sinks is None else SINKS
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(HEADS, CACHE, META, META, META, META, sinks_spec),
            out_specs=HEADS,
            check_vma=False,
        )(q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, sinks)

    sharded = {**attention_kwargs, "attention_fn": attention, "update_fn": update}
    if attention_kwargs.get("gated_delta_fn") is not None:
        sharded["gated_delta_fn"] = shard_gated_delta(attention_kwargs["gated_delta_fn"], mesh)
    if attention_kwargs.get("state_write_fn") is not None:
        sharded["state_write_fn"] = shard_state_write(attention_kwargs["state_write_fn"], mesh)
    return sharded


def with_real_heads(attention_kwargs: dict, heads_per_device: int) -> dict:
    """``attention_kwargs`` whose ``attention_fn`` is passed ``num_kv_heads`` (a
    device's KV heads) when its cache has more rows than their K and V (padded on TPU);
    a cache of exactly those rows (every other platform) calls it unchanged."""
    attention_fn = attention_kwargs.get("attention_fn")
    if attention_fn is None:
        return attention_kwargs

    def attention(q, kv_cache, *args, **kwargs):
        if kv_cache.ndim == 4 and kv_cache.shape[2] > 2 * heads_per_device:
            kwargs["num_kv_heads"] = heads_per_device
        return attention_fn(q, kv_cache, *args, **kwargs)

    return {**attention_kwargs, "attention_fn": attention}


def shard_gated_delta(rule: Callable, mesh: Mesh) -> Callable:
    """``rule`` (the gated delta rule's signature) run per tensor shard of its heads."""
    tp = mesh.shape["tensor"]
    by_head = P(None, "tensor")  # [T, Hv]: g, beta
    pool = P(None, "tensor")  # [S, Hv, Dk, Dv]

    def sharded(q, k, v, g, beta, query_start_loc, num_seqs, state_pool, state_rows, fresh):
        args = (q, k, v, g, beta, query_start_loc, num_seqs, state_pool, state_rows, fresh)
        split = q.shape[1] % tp == 0  # else every device runs all heads (replicated)
        heads, rows, states = (HEADS, by_head, pool) if split else (META, META, META)
        return jax.shard_map(
            rule,
            mesh=mesh,
            in_specs=(heads, heads, heads, rows, rows, META, META, states, META, META),
            out_specs=(heads, states),
            check_vma=False,
        )(*args)

    return sharded


def shard_state_write(write: Callable, mesh: Mesh) -> Callable:
    """``write`` (``(pool, rows, keep, states) -> pool``) per tensor shard of the
    convolution windows' channel-major rows ``[S, conv_dim * (K - 1) / tp]``, as the
    pool is placed (`runner.states`)."""
    channels = P(None, "tensor")  # [S or R, C * (K - 1)]
    return jax.shard_map(
        write,
        mesh=mesh,
        in_specs=(channels, META, META, channels),
        out_specs=channels,
        check_vma=False,
    )
