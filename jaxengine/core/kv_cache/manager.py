"""KVCacheManager: per-request block tables on top of the block pool and prefix cache.

The scheduler talks to this class only, and sees block ids (ints) only.

Life of a request's blocks:

1. `get_computed_blocks(req)`: the longest chain of cached full blocks matching the
   request's tokens (never all of them: the last token is always computed, so logits
   exist). Pure query, nothing is taken.
2. `allocate_slots(req, n, hits)`: take the hits (ref count + 1) and fresh blocks for
   `num_computed_tokens + n` tokens; all or nothing (None when blocks are short).
   Fresh blocks come from the free list's head, evicting cached free blocks LRU.
3. `cache_full_blocks(req)` after a step: full blocks whose tokens are all computed are
   registered in the prefix cache. Only computed blocks are published, so no request can
   hit a block whose KV is still being written in the same step.
4. `free(req)`: drop the references, tail of the sequence first, so the tail of a
   sequence is evicted before its (more shareable) head.

Swap preemption: `swap_out` moves a request's table to host blocks and returns
(device, host) pairs; `swap_in` the reverse, (host, device). The manager only does the
bookkeeping: the runner copies the pages, swap-outs before swap-ins, both before the
step's forward pass (a swapped-out device block may be reused in the same step).

Linear-attention states (a hybrid model's, ``state_rows``): a hit must also resume its
recurrent state, so hits stop at the last block whose end state was saved
(`core.kv_cache.state_cache`); `reserve_state_save` and `state_restore_row` give the
rows the runner copies.

Invariant: a block's ref count equals the number of request tables holding it; after
every request is freed, every block is free.
"""

from __future__ import annotations

from typing import Any, Protocol

from jaxengine.core.kv_cache.block_pool import BlockPool, KVBlock
from jaxengine.core.kv_cache.hashing import extend_block_hashes, get_hash_fn
from jaxengine.core.kv_cache.state_cache import StateCache


class Request(Protocol):
    """What the manager reads of a request (`core.request.Request`): the KV cache
    sits below the request's lifecycle and knows nothing else of it."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: list[Any]  # extended here, as the request's tokens fill blocks
    skip_prefix_cache: bool
    mm_items: tuple[Any, ...]  # its images: their keys enter the blocks they fill

    def image_keys(self, start: int, end: int) -> tuple[str, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_tokens_with_placeholders(self) -> int: ...

    @property
    def prefix_salt(self) -> Any: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for requests; prefix caching; device<->host swap bookkeeping."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        num_host_blocks: int = 0,
        state_rows: tuple[int, int] = (0, 0),
    ) -> None:
        """``state_rows``: (first row, count) of a hybrid model's state pools kept
        for saved states (`core.kv_cache.state_cache`); count 0: none."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = BlockPool(num_blocks)
        self.host_pool = (
            BlockPool(num_host_blocks, reserve_null_block=False) if num_host_blocks else None
        )
        self._tables: dict[str, list[KVBlock]] = {}
        first, count = state_rows
        self.states = StateCache(first, count) if enable_caching and count else None
        self._num_cached: dict[str, int] = {}  # leading blocks already in the cache map
        self._host_tables: dict[str, list[KVBlock]] = {}
        self.prefix_queries = 0
        """Tokens looked up in the prefix cache (requests' num_tokens at admission)."""
        self.prefix_hits = 0
        """Tokens found in the prefix cache."""

    # ---- queries -----------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of usable device blocks held by requests, in [0, 1]."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_stats(self) -> dict[str, int]:
        """`SchedulerStats`' block fields: the usable device blocks (the null block
        excluded), and those in the prefix cache now (held by requests, or free until
        evicted: what a new request could find) with the tokens they hold."""
        cached = len(self.pool.cached)
        return {
            "num_kv_cache_total_blocks": self.pool.num_usable_blocks,
            "num_prefix_cached_blocks": cached,
            "num_prefix_cached_tokens": cached * self.block_size,
        }

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's device block table (empty when it holds none)."""
        return [b.block_id for b in self._tables.get(request_id, ())]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            num_tokens,
            self.block_size,
            self.hash_fn,
            request.prefix_salt,
            request.image_keys if request.mm_items else None,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """(block ids, num tokens) of the longest cached prefix of the request's tokens.

        Covers at most `num_tokens - 1` tokens, in whole blocks. Takes no reference;
        pass the ids to `allocate_slots` in the same step.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block.block_id)
        if self.states is not None:
            hits = hits[: self.states.usable_blocks(request.block_hashes, len(hits))]
        return hits, len(hits) * self.block_size

    def state_restore_row(self, request: Request, num_hit_tokens: int) -> int | None:
        """The saved-state row a hit of ``num_hit_tokens`` tokens resumes from (None
        without a hit or without states)."""
        if self.states is None or not num_hit_tokens:
            return None
        return self.states.row_for(request.block_hashes[num_hit_tokens // self.block_size - 1])

    def chunk_end(self, request: Request, start: int, n: int) -> int:
        """``n`` new tokens from ``start``, or fewer so that a partial prefill chunk
        ends at a block's end, where a hybrid model's state is saved (with states)."""
        if self.states is None or start + n >= request.num_tokens_with_placeholders:
            return n
        end = (start + n) // self.block_size * self.block_size
        return end - start if end > start else n

    def reserve_state_save(self, request: Request, end: int) -> int | None:
        """The row to save ``request``'s state into after a step that computes it up
        to position ``end``: only at the end of a block (None elsewhere, without
        states, or when every row waits for a save). Past the prompt, the request's
        previous such row is reused (`StateCache.reserve`'s rolling save)."""
        if self.states is None or end <= 0 or end % self.block_size:
            return None
        rolling = end > request.num_prompt_tokens
        return self.states.reserve(request.request_id, end // self.block_size - 1, rolling)

    # ---- allocation --------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hits: int = 0) -> int:
        """Fresh blocks `allocate_slots` would take (beyond the table and hits)."""
        held = len(self._tables.get(request.request_id, ())) + num_hits
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - held)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | tuple[int, ...] = (),
    ) -> list[int] | None:
        """Make room for `num_new_tokens` after the computed ones (and the hits).

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`; only on a
        request that holds no blocks and has num_computed_tokens == 0. Returns the block
        ids appended to the request's table (hits first, then fresh blocks), or None when
        the free list cannot cover them, in which case nothing changed.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table and not new_computed_blocks:  # fast path: a decode within its last block
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size:
                return []
        if new_computed_blocks and (request.num_computed_tokens or table):
            raise ValueError(f"{rid}: prefix hits on a request that already has blocks")
        hits = [self.pool.blocks[i] for i in new_computed_blocks]
        need = self.num_blocks_needed(request, num_new_tokens, len(hits))
        hits_in_free_list = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - hits_in_free_list:
            return None
        first_alloc = rid not in self._tables
        if first_alloc and self.enable_caching and not request.skip_prefix_cache:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        self.pool.touch(hits)
        new_blocks = hits + self.pool.get_new_blocks(need)
        table = self._tables.setdefault(rid, [])
        if first_alloc:
            self._num_cached[rid] = len(hits)
        table.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose tokens are all computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        known = min(request.num_computed_tokens, request.num_tokens)  # not placeholders
        num_full = min(known // self.block_size, len(table))
        start = self._num_cached.get(rid, 0)
        if num_full > start:
            self._update_hashes(request, num_full * self.block_size)
            for i in range(start, num_full):
                self.pool.cache_block(table[i], request.block_hashes[i])
            self._num_cached[rid] = num_full
        if self.states is not None:
            self.states.publish(rid, request.block_hashes, num_full)

    def free(self, request: Request) -> None:
        """Release every block the request holds (device and host). Idempotent."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._num_cached.pop(rid, None)
        if self.states is not None:
            self.states.drop(rid)
        if table:
            self.pool.free_blocks(reversed(table))
        host = self._host_tables.pop(rid, None)
        if host:
            self.host_pool.free_blocks(reversed(host))

    # ---- swap --------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        table = self._tables.get(request.request_id, ())
        return bool(table) and len(table) <= self.num_free_host_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's table to host blocks; returns (device, host) copy pairs.

        The device blocks are freed (cached ones stay findable until reused)."""
        rid = request.request_id
        table = self._tables.pop(rid)
        self._num_cached.pop(rid, None)
        host = self.host_pool.get_new_blocks(len(table))
        self._host_tables[rid] = host
        self.pool.free_blocks(reversed(table))
        return [(d.block_id, h.block_id) for d, h in zip(table, host, strict=True)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether swap_in plus allocate_slots(request, num_new_tokens) will succeed."""
        host = self._host_tables.get(request.request_id, ())
        total = request.num_computed_tokens + num_new_tokens
        return max(len(host), cdiv(total, self.block_size)) <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's host blocks back to fresh device blocks; returns
        (host, device) copy pairs. Call `allocate_slots` next for the new tokens."""
        rid = request.request_id
        host = self._host_tables.pop(rid)
        table = self.pool.get_new_blocks(len(host))
        self._tables[rid] = table
        self._num_cached[rid] = 0
        self.host_pool.free_blocks(reversed(host))
        return [(h.block_id, d.block_id) for h, d in zip(host, table, strict=True)]

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    # ---- maintenance -------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; only when no request holds blocks. Returns success."""
        done = self.pool.reset_prefix_cache()
        if done and self.states is not None:
            self.states.reset()
        return done

    def check_invariants(self) -> None:
        """Pool invariants, plus: ref count == number of tables holding the block."""
        self.pool.check_invariants()
        for pool, tables in ((self.pool, self._tables), (self.host_pool, self._host_tables)):
            if pool is None:
                continue
            counts = [0] * pool.num_blocks
            for table in tables.values():
                for block in table:
                    counts[block.block_id] += 1
            for block in pool.blocks:
                assert block.ref_cnt == counts[block.block_id], (block, counts[block.block_id])
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        if self.states is not None:
            self.states.check_invariants()
