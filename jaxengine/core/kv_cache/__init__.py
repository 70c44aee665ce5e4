"""The paged KV cache, host side: block pool -> prefix cache (chained hashes) -> manager.

Layers: `hashing` (chained block hashes), `block_pool` (pages, ref counts, LRU free
list, hash -> block map), `manager` (per-request block tables, prefix hits, swap).
The scheduler uses `KVCacheManager` and sees block ids only. No jax here.
"""

from jaxengine.core.kv_cache.block_pool import BlockPool, KVBlock
from jaxengine.core.kv_cache.hashing import BlockHash, get_hash_fn, hash_block_tokens
from jaxengine.core.kv_cache.manager import KVCacheManager

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "get_hash_fn",
    "hash_block_tokens",
]
