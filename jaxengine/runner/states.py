"""The caches of a model with linear-attention layers (Qwen3-Next, Qwen3.5): pages for
its attention layers, state pools for the others, and what their memory admits.

A hybrid model's per-layer cache tuple mixes two kinds of entries
(`models.layers.gated_delta.layer_state_shapes`): a paged array ``[num_blocks,
page_size, 2 * Hkv, D]`` for a full-attention layer, and a pair of float32 state pools
``([S, conv_dim * (K - 1)], [S, Hv, Dk, Dv])`` for a Gated DeltaNet layer, one slot per
running request (``S = max_num_seqs``; `runner.request_table` hands the slots out).
The pools' memory is fixed by ``max_num_seqs``, so it comes out of the KV budget
before pages are sized (`state_bytes`, `worker.build`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.program import _placed

logger = logging.getLogger(__name__)

STATE_DTYPE = jnp.float32


def make_caches(program: Any, settings: Any, abstract: bool = False) -> Any:
    """The runner's caches: ``program``'s pages for every layer, or, with
    ``settings.state_shapes`` (a hybrid model), pages for its attention layers and
    zeroed state pools for the others (one tensor group only). ``abstract``: placed
    shapes, nothing allocated."""
    shape = (settings.num_blocks, *settings.cache_page_shape)
    states = getattr(settings, "state_shapes", None)
    if states is None:
        if abstract:
            return program.abstract_caches(shape, settings.cache_dtype)
        return program.allocate_caches(shape, settings.cache_dtype)
    plan = getattr(program, "plan", None)
    pages = None if plan is None else plan.kv_cache_sharding
    placed = _state_shardings(plan)
    specs = []
    for entry in states:
        if entry is None:
            specs.append((shape, settings.cache_dtype, pages))
        else:
            specs.append(tuple((s, STATE_DTYPE, p) for s, p in zip(entry, placed, strict=True)))
    if abstract:
        return _abstract(specs)
    return _zeros(specs)


def _state_shardings(plan: Any) -> tuple:
    """Where the (conv window, delta-rule state) pools live: split like the layer's
    channels and value heads over ``tensor`` (where the step's partitioner puts
    them, so a step's output pools are placed as its inputs), whole on one device."""
    if plan is None or plan.tensor_size == 1:
        return (None if plan is None else plan.replicated,) * 2
    from jax.sharding import NamedSharding, PartitionSpec

    conv = heads = PartitionSpec(None, "tensor")  # channel-major windows; value heads
    return NamedSharding(plan.mesh, conv), NamedSharding(plan.mesh, heads)


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def _abstract(specs: list) -> tuple:
    def one(spec):
        shape, dtype, sharding = spec
        struct = jax.ShapeDtypeStruct(shape, dtype)
        return struct if sharding is None else _placed(struct, sharding)

    return tuple(jax.tree_util.tree_map(one, specs, is_leaf=_is_spec))


def _zeros(specs: list) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
    placed = [sharding for _, _, sharding in leaves]
    shardings = None if any(s is None for s in placed) else tuple(placed)
    make = jax.jit(
        lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in leaves),
        out_shardings=shardings,
    )
    return tuple(jax.tree_util.tree_unflatten(tree, list(make())))


def state_bytes(state_shapes: tuple | None, layers: range | None = None) -> int:
    """Bytes of the state pools of ``state_shapes`` (the layers in ``layers``: one
    pipeline stage's; None: all), float32."""
    if state_shapes is None:
        return 0
    chosen = state_shapes if layers is None else [state_shapes[i] for i in layers]
    itemsize = jnp.dtype(STATE_DTYPE).itemsize
    total = 0
    for entry in chosen:
        for shape in entry or ():
            count = 1
            for n in shape:
                count *= n
            total += count * itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Admission:
    """How many requests of one length a memory budget holds (`admitted_requests`)."""

    requests: int
    kv_bytes_per_request: int
    state_bytes_per_request: int


def admitted_requests(
    config: Any, budget_bytes: int, num_tokens: int, *, block_size: int = 16, itemsize: int = 2
) -> Admission:
    """Concurrent requests of ``num_tokens`` tokens that ``budget_bytes`` of cache
    holds for ``config`` (a `TransformerConfig`): each takes the pages of its
    attention layers (K and V, ``itemsize`` bytes each) and, in a hybrid model, one
    float32 state per linear-attention layer. Host-side arithmetic, on one device."""
    from jaxengine.models.layers.gated_delta import layer_state_shapes

    states = layer_state_shapes(config, 1)
    num_attention = sum(1 for s in states if s is None) if states else config.num_layers
    pages = -(-num_tokens // block_size)
    kv_row = 2 * config.num_kv_heads * config.head_dim * itemsize
    kv = num_attention * pages * block_size * kv_row
    state = state_bytes(states)
    return Admission(budget_bytes // (kv + state), kv, state)


def hybrid_limits(config: Any, limits: Any, state_shapes: tuple | None) -> Any:
    """The scheduler's limits (`core.limits.SchedulerLimits`) for a hybrid model: its
    saved states' rows for prefix caching (`pool_rows`); raises for what it cannot
    run (speculative decoding, pipeline stages). Unchanged without ``state_shapes``.
    (Swap preemption moves the states with the pages: `runner.state_swap`.)"""
    if state_shapes is None:
        return limits
    if config.speculative_config.enabled:
        raise ValueError(
            "speculative decoding is not supported for models with linear-attention "
            "layers (Qwen3-Next, Qwen3.5): their recurrent state cannot be rolled back"
        )
    if config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("pipeline parallelism is not supported for linear-attention models")
    slots, saved = pool_rows(config)
    rows = (slots, saved if limits.enable_prefix_caching else 0)
    return dataclasses.replace(limits, state_cache_rows=rows)


def reserve_states(
    state_shapes: tuple | None, kv_cache_memory_bytes: int | None, memory: Any
) -> tuple[int | None, Any]:
    """``(--kv-cache-memory-bytes, device (limit, in use))`` with the state pools'
    bytes taken out first, so pages are sized from what is left; logs the pools."""
    reserved = state_bytes(state_shapes)
    if not reserved:
        return kv_cache_memory_bytes, memory
    slots = next(entry[0][0] for entry in state_shapes if entry is not None)
    logger.info(
        "linear-attention states: %d layers x %d rows (request slots and saved states), "
        "%.3f GiB, taken from the KV-cache budget",
        sum(entry is not None for entry in state_shapes), slots, reserved / (1 << 30),
    )  # fmt: skip
    if kv_cache_memory_bytes is not None:
        kv_cache_memory_bytes -= reserved
    if memory is not None:
        memory = (memory[0], memory[1] + reserved)
    return kv_cache_memory_bytes, memory


class StateCopier:
    """Copies rows of a hybrid model's state pools, every linear-attention layer at
    once: a prefix hit's saved state into its request's slot before a step, a
    request's state into a saved-state row after one (`core.kv_cache.state_cache`).
    One compiled program moves ``chunk`` rows a call, padded with rows past the
    pools' end, which the scatter drops; the pools are donated (updated in place)."""

    def __init__(self, num_rows: int, chunk: int = 8) -> None:
        self.num_rows = num_rows
        self.chunk = chunk
        self._copy = jax.jit(_copy_rows, donate_argnums=0)
        self._compiled = None

    def precompile(self, caches: Any) -> None:
        """Compiles the copy for ``caches``' pools (placed shapes will do)."""
        index = jax.ShapeDtypeStruct((self.chunk,), jnp.int32)
        self._compiled = self._copy.lower(state_pools(caches), index, index).compile()

    def copy(self, caches: tuple, pairs: list[tuple[int, int]]) -> tuple:
        """``caches`` with each (source row, destination row) of ``pairs`` copied, in
        order (the caches passed in are donated)."""
        if not pairs:
            return caches
        pools = state_pools(caches)
        for i in range(0, len(pairs), self.chunk):
            part = pairs[i : i + self.chunk]
            src = np.zeros(self.chunk, np.int32)
            dst = np.full(self.chunk, self.num_rows, np.int32)  # past the end: dropped
            src[: len(part)], dst[: len(part)] = zip(*part, strict=True)
            pools = self._compiled(pools, src, dst)
        return with_pools(caches, pools)


def state_pools(caches: tuple) -> tuple:
    """The (conv window, delta-rule state) pools of ``caches``' linear-attention layers."""
    return tuple(entry for entry in caches if isinstance(entry, tuple))


def with_pools(caches: tuple, pools: tuple) -> tuple:
    """``caches`` with its linear-attention layers' entries replaced by ``pools``."""
    it = iter(pools)
    return tuple(next(it) if isinstance(entry, tuple) else entry for entry in caches)


def _copy_rows(pools: tuple, src: jax.Array, dst: jax.Array) -> tuple:
    return jax.tree_util.tree_map(lambda p: p.at[dst].set(p[src], mode="drop"), pools)


def state_copier(settings: Any) -> StateCopier | None:
    """The copier of a hybrid model whose pools keep saved states (rows past its
    ``max_num_seqs`` request slots, `pool_rows`); None for any other model."""
    shapes = getattr(settings, "state_shapes", None)
    if not shapes:
        return None
    rows = next(entry[0][0] for entry in shapes if entry is not None)
    return StateCopier(rows) if rows > settings.max_num_seqs else None


def slot_pairs(table: Any, pairs: tuple, restore: bool) -> list[tuple[int, int]]:
    """(source row, destination row) for each (request, saved-state row) of a
    `SchedulerOutput`'s ``state_restores`` (``restore``: the saved row into the
    request's slot) or ``state_saves`` (the slot into the saved row)."""
    out = []
    for req_id, row in pairs:
        slot = table[req_id].state_slot
        out.append((row, slot) if restore else (slot, row))
    return out


def pool_rows(config: Any) -> tuple[int, int]:
    """A hybrid model's state-pool rows: (request slots, saved states). Saved states
    (prefix caching's) take half as many rows again as there are request slots, at
    least 4 (a few saved prefixes survive the rolling saves of a small batch)."""
    slots = config.scheduler_config.max_num_seqs
    return slots, max(4, slots // 2) if config.cache_config.prefix_caching else 0
