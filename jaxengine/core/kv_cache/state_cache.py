"""Prefix caching for linear-attention states (Qwen3-Next, Qwen3.5): the recurrent
state of a request at the end of a full block, kept under that block's hash.

A hybrid model's attention layers hit the prefix cache through their pages, but its
Gated DeltaNet layers keep one state per request that no page holds: a prefix hit can
only resume where the state of that prefix was saved. The state pools have, after
the running requests' slots, ``num_rows`` more rows for saved states; this class
owns those rows (host bookkeeping only; the runner copies the rows).

Life of a saved state:

1. `reserve(req, block, rolling)` when the scheduler plans a step whose chunk of
   ``req`` ends at the end of its block ``block`` (block index + 1 = blocks
   covered): takes a row, LRU-evicting a published one. The runner copies the
   request's state into it after that step's forward pass.
2. `publish(req, hashes, num_known)` after the step: once the block's tokens are all
   known its hash names the row, and a prefix hit may use it.
3. `row_for(hash)` at a hit: the row to copy into the request's own slot before the
   step's forward pass (a copy in a later step comes after the save on the device).
4. A request's *rolling* save (one past its prompt: decode crosses a block boundary
   every ``block_size`` tokens) replaces its previous rolling save, so a decoding
   request holds one row, the latest, which stays cached after it finishes (the next
   turn of a chat resumes there). Saves within the prompt are kept until evicted.

Rows in use by a pending save are never handed out again; a published row is
evicted only when a new save needs a row and none is free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BlockHash = Any


class StateCache:
    """``num_rows`` state-pool rows from ``first_row`` on, by block hash, LRU."""

    def __init__(self, first_row: int, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"a state cache needs rows, got {num_rows}")
        self.first_row = first_row
        self.num_rows = num_rows
        self._free = list(range(first_row + num_rows - 1, first_row - 1, -1))
        self._rows: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._hash_of: dict[int, BlockHash] = {}
        self._pending: dict[str, list[tuple[int, int, bool]]] = {}  # req -> (row, block, rolling)
        self._rolling: dict[str, int] = {}  # req -> its published rolling row

    # ---- queries -----------------------------------------------------------------
    def __len__(self) -> int:
        """Published states."""
        return len(self._rows)

    def usable_blocks(self, hashes: list[BlockHash], num_hits: int) -> int:
        """The longest prefix of ``num_hits`` hit blocks whose last block has a saved
        state (0: none has one)."""
        for n in range(num_hits, 0, -1):
            if hashes[n - 1] in self._rows:
                return n
        return 0

    def row_for(self, block_hash: BlockHash) -> int:
        """The row holding the state saved at the end of ``block_hash``'s block
        (marks it recently used)."""
        self._rows.move_to_end(block_hash)
        return self._rows[block_hash]

    # ---- saves -------------------------------------------------------------------
    def reserve(self, req_id: str, block: int, rolling: bool) -> int | None:
        """A row for ``req_id``'s state at the end of its block ``block``; None when
        every row waits for a save."""
        row = self._rolling.pop(req_id, None) if rolling else None
        if row is not None:
            self._unpublish(row)
        elif self._free:
            row = self._free.pop()
        elif self._rows:
            _, row = self._rows.popitem(last=False)
            owner = [r for r, held in self._rolling.items() if held == row]
            for r in owner:
                del self._rolling[r]
            del self._hash_of[row]
        else:
            return None
        self._pending.setdefault(req_id, []).append((row, block, rolling))
        return row

    def publish(self, req_id: str, hashes: list[BlockHash], num_known_blocks: int) -> None:
        """Names ``req_id``'s pending saves at the end of one of its first
        ``num_known_blocks`` blocks by their hashes (``hashes`` covers them)."""
        waiting = self._pending.get(req_id)
        if not waiting:
            return
        left = []
        for row, block, rolling in waiting:
            if block >= num_known_blocks:
                left.append((row, block, rolling))
                continue
            block_hash = hashes[block]
            if block_hash in self._rows:  # another request saved the same prefix
                self._free.append(row)
                continue
            self._rows[block_hash] = row
            self._hash_of[row] = block_hash
            if rolling:
                self._rolling[req_id] = row
        if left:
            self._pending[req_id] = left
        else:
            del self._pending[req_id]

    def drop(self, req_id: str) -> None:
        """``req_id`` holds no blocks any more: its unpublished saves are void (their
        rows free), its published ones stay cached."""
        for row, _, _ in self._pending.pop(req_id, ()):
            self._free.append(row)
        self._rolling.pop(req_id, None)

    def reset(self) -> None:
        """Forgets every published state (pending saves stay)."""
        for row in list(self._hash_of):
            self._unpublish(row)
            self._free.append(row)
        self._rolling.clear()

    def _unpublish(self, row: int) -> None:
        """Takes ``row``'s hash away (the caller hands the row on)."""
        del self._rows[self._hash_of.pop(row)]

    def check_invariants(self) -> None:
        """Every row is exactly one of: free, pending, published."""
        pending = [r for saves in self._pending.values() for r, _, _ in saves]
        published = list(self._rows.values())
        rows = sorted(self._free + pending + published)
        assert rows == list(range(self.first_row, self.first_row + self.num_rows)), rows
        assert all(self._rows[h] == r for r, h in self._hash_of.items())
        assert all(r in self._hash_of for r in self._rolling.values())
