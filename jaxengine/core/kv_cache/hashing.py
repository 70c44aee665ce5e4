"""Chained block hashes: the keys of the prefix cache.

The hash of block i covers the whole prefix up to and including block i:

    h[i] = H((h[i-1], tuple(tokens of block i), extra_keys[i]))     h[-1] = ROOT

so two requests share block i's KV only if their first (i + 1) * block_size tokens
(and extra keys, e.g. the cache salt, which enters block 0) are equal. Only full blocks
are hashed.

Algorithms (CacheConfig.prefix_caching_hash_algo):

- "builtin": Python's `hash` of the tuple; an int, fast. Int tuples hash the same in
  every process; a str salt does not (PYTHONHASHSEED), which is fine because the cache
  lives in one process. 64-bit: a tiny collision risk.
- "sha256": SHA-256 over a pickle (protocol 5) of the tuple; 32 bytes, collision
  resistant and stable across processes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = Any
"""Opaque, hashable (int for "builtin", bytes for "sha256")."""

HashFn = Callable[[object], BlockHash]

_ROOT_SEED = "jaxengine-prefix-root"


def builtin_hash(obj: object) -> int:
    return hash(obj)


def sha256_hash(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


_HASH_FNS: dict[str, HashFn] = {"builtin": builtin_hash, "sha256": sha256_hash}


def get_hash_fn(algo: str) -> HashFn:
    """The hash function for a CacheConfig.prefix_caching_hash_algo value."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}") from None


def root_hash(hash_fn: HashFn) -> BlockHash:
    """The parent hash of block 0 (constant per algorithm)."""
    return hash_fn(_ROOT_SEED)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
) -> BlockHash:
    """Hash one full block, chained on its parent's hash."""
    return hash_fn((parent_hash, tuple(token_ids), extra_keys))


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    hash_fn: HashFn,
    cache_salt: Any = None,
    image_keys: Callable[[int, int], tuple] | None = None,
) -> list[BlockHash]:
    """Append the hashes of the full blocks in `token_ids[:num_tokens]` not yet hashed.

    `block_hashes` is a request's list (mutated in place and returned); it always holds
    the hashes of blocks 0..len-1, since tokens are append-only. ``image_keys(start,
    end)``: the content keys of the images at those positions (their placeholder
    tokens are the same for every image), hashed into each block they touch.
    """
    num_full = num_tokens // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else root_hash(hash_fn)
        extra = (cache_salt,) if (i == 0 and cache_salt is not None) else ()
        if image_keys is not None:
            extra += image_keys(i * block_size, (i + 1) * block_size)
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(hash_fn, parent, chunk, extra))
    return block_hashes
