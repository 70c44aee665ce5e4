"""Picking a data-parallel replica for each request (host side, no jax).

With ``--data-parallel-size N`` there are N engines, each with its own scheduler and
KV cache. `DPBalancer.choose` sends a request to the replica with the least load
(running + waiting requests; the lowest index on a tie), except that a prompt whose
leading full KV blocks were last sent to some replica goes there again while that
replica is at most ``margin`` requests busier than the least loaded one: there its
prefix is likely still cached, and a prefix-cache hit saves more than a slightly
shorter queue would.

The affinity key of a prompt is the chained hash (`core.kv_cache.hashing`, the same
scheme as the prefix cache) of each of its first ``affinity_blocks`` full blocks; the
longest remembered one wins. Prompts shorter than one block have no affinity. The
memory is an LRU map of at most ``capacity`` keys.

Not thread-safe: one caller (the event loop, or the offline `LLM`) chooses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from jaxengine.core.kv_cache.hashing import builtin_hash, extend_block_hashes


class DPBalancer:
    """Load balancing over ``num_replicas`` engines, with prefix-cache affinity."""

    def __init__(
        self,
        num_replicas: int,
        *,
        block_size: int = 16,
        affinity_blocks: int = 4,
        margin: int = 2,
        capacity: int = 16384,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if block_size < 1 or affinity_blocks < 0 or margin < 0 or capacity < 1:
            raise ValueError("block_size and capacity must be >= 1; affinity_blocks, margin >= 0")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.margin = margin
        self.capacity = capacity
        self._last_replica: OrderedDict[object, int] = OrderedDict()  # prefix key -> replica

    def choose(
        self, token_ids: Sequence[int], loads: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """The replica for a prompt, given each replica's load (running + waiting).

        Remembers the choice as the last replica of the prompt's leading blocks.
        """
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads given for {self.num_replicas} replicas")
        least = min(range(self.num_replicas), key=lambda i: (loads[i], i))
        keys = self._prefix_keys(token_ids, cache_salt)
        preferred = self._lookup(keys)
        chosen = least
        if preferred is not None and loads[preferred] - loads[least] <= self.margin:
            chosen = preferred
        self._remember(keys, chosen)
        return chosen

    def _prefix_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[object]:
        """Chained hashes of the prompt's first (up to ``affinity_blocks``) full blocks."""
        num_tokens = min(len(token_ids), self.affinity_blocks * self.block_size)
        return extend_block_hashes(
            [], token_ids, num_tokens, self.block_size, builtin_hash, cache_salt
        )

    def _lookup(self, keys: list[object]) -> int | None:
        for key in reversed(keys):  # the longest shared prefix first
            replica = self._last_replica.get(key)
            if replica is not None:
                return replica
        return None

    def _remember(self, keys: list[object], replica: int) -> None:
        for key in keys:
            self._last_replica[key] = replica
            self._last_replica.move_to_end(key)
        while len(self._last_replica) > self.capacity:
            self._last_replica.popitem(last=False)
