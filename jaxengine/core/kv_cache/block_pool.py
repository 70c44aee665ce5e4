"""Block pool: the fixed set of KV pages, their ref counts, the free list and the
prefix-cache map (block hash -> block).

Invariants (checked by `check_invariants`, used in tests):

- Block 0 is the null page when `reserve_null_block`: never handed out, never free,
  never cached. Runners point padding slots at it.
- A block is in the free list iff its ref count is 0 (null block excepted).
- The free list is in eviction order: `get_new_blocks` pops from its head. Freed blocks
  that carry a hash join the tail (least recently used evicted first); freed blocks
  without one join the head, since they hold nothing reusable.
- `cached[h] is b` iff `b.block_hash == h`. A cached block may be free (ref 0): its KV
  stays valid and findable until the block is popped for reuse, which evicts it.
- One block per hash: if a second block computes the same content, it stays uncached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from jaxengine.core.kv_cache.hashing import BlockHash


class KVBlock:
    """One page of KV cache (on device, or on host for the swap pool)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """`num_blocks` pages with ref counts, an LRU free list and a hash -> block map."""

    def __init__(self, num_blocks: int, *, reserve_null_block: bool = True) -> None:
        first = 1 if reserve_null_block else 0
        if num_blocks <= first:
            raise ValueError(f"num_blocks={num_blocks} leaves no usable block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block: KVBlock | None = self.blocks[0] if reserve_null_block else None
        # Ordered set of free block ids, head = next to be reused (evicted).
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(first, num_blocks)
        )
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_usable_blocks = num_blocks - first

    # ---- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached-but-free ones included: they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (ref count > 0)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    # ---- allocation --------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop `n` blocks from the free list's head (evicting their cache entries);
        each comes back with ref count 1. Raises if fewer than n are free."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free block
        leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching 0 join
        the free list (cached ones at the tail, in this order, others at the head)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # ---- prefix cache ------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. Returns whether the map now
        points at this block (False when another block already holds the hash)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use; returns success."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    # ---- testing -----------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        if self.null_block is not None:
            nb = self.null_block
            assert nb.ref_cnt == 0 and nb.block_hash is None and 0 not in self._free
        for block in self.blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for h, block in self.cached.items():
            assert block.block_hash == h
