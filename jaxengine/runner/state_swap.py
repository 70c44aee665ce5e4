"""Swap preemption for a hybrid model's linear-attention states.

Swap preemption moves a request's pages to host pages (`runner.swap`); a hybrid
model's request also holds one row of each state pool (`runner.states`), which the
runner hands to another request while this one waits. `HostStates` keeps the rows on
the host instead: read when the request is preempted, written into its new slot when
it resumes with its computed tokens kept (a swap-in). A recompute, or a prefix hit
that restores a saved state, drops them. One compiled program reads a row, one writes
it back (the pools donated).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.core.sched_output import SchedulerOutput
from jaxengine.runner.states import state_pools, with_pools


class HostStates:
    """Preempted requests' state rows, on the host, by request id."""

    def __init__(self) -> None:
        self._read = jax.jit(_read_row)
        self._write = jax.jit(_write_row, donate_argnums=0)
        self._compiled: tuple | None = None
        self.rows: dict[str, tuple] = {}  # request -> its rows, shaped as the pools

    def precompile(self, caches: Any) -> None:
        """Compiles the read and the write for ``caches``' pools (placed shapes)."""
        pools = state_pools(caches)
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        values = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), pools)
        read = self._read.lower(pools, slot).compile()
        self._compiled = (read, self._write.lower(pools, slot, values).compile())

    def stash(self, caches: tuple, out: SchedulerOutput, table: Any) -> None:
        """Before the table forgets them: the rows of ``out``'s preempted requests
        (``table``: the runner's `RequestTable`); forgets finished requests' rows."""
        for req_id in out.finished_req_ids:
            self.rows.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            slot = table[req_id].state_slot if req_id in table.requests else -1
            if slot >= 0:
                got = self._compiled[0](state_pools(caches), np.int32(slot))
                self.rows[req_id] = jax.tree_util.tree_map(np.asarray, got)

    def restore(self, caches: tuple, out: SchedulerOutput, table: Any) -> tuple:
        """After the table gave resumed requests their slots: the stashed rows of
        those that resume where they were (swapped in), written back; returns the
        caches (the ones passed in are donated)."""
        restored = dict(out.state_restores)
        for cached in out.scheduled_cached_reqs:
            rows = self.rows.pop(cached.req_id, None) if cached.resumed_from_preemption else None
            if rows is None or not cached.num_computed_tokens or cached.req_id in restored:
                continue  # recomputed from the start, or from a saved state
            slot = np.int32(table[cached.req_id].state_slot)
            caches = with_pools(caches, self._compiled[1](state_pools(caches), slot, rows))
        return caches


def _read_row(pools: tuple, slot: jax.Array) -> tuple:
    return jax.tree_util.tree_map(lambda p: p[slot], pools)


def _write_row(pools: tuple, slot: jax.Array, values: tuple) -> tuple:
    return jax.tree_util.tree_map(lambda p, v: p.at[slot].set(v), pools, values)
