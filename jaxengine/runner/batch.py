"""Packing scheduled tokens into one flat ragged batch of fixed (bucket) shape.

Host side, numpy only. The runner calls `pack_batch` each step and ships the arrays to
the device; the jitted step sees only the bucket's shapes. Padding tokens write into
slot 0 of the reserved null page 0 and padding requests have no tokens, so they cost
little and never produce NaN. ``feed_rows`` starts at -1 (every token id is known);
with async scheduling the runner points a token whose id is still being sampled at
its row of the previous step's sampled ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

NULL_PAGE = 0  # reserved page: never handed to a request, written by padding tokens


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """One request's share of a step: new tokens after ``num_computed`` cached ones."""

    token_ids: Sequence[int]
    num_computed: int
    page_ids: Sequence[int]
    lora_slot: int = 0  # its adapter's slot (`models.layers.lora`; 0: the base model)
    num_logits: int = 1  # logits rows: its last tokens' (1 + proposals when speculating)
    image_rows: Sequence[int] | None = None  # per token: its image embedding row, or -1
    attend_until: Sequence[int] | None = None  # per token: its last key (None: itself)
    mrope_positions: np.ndarray | None = None  # [3, n]: M-RoPE rows (None: as text)
    state_row: int = -1  # its slot in a hybrid model's state pools (`runner.states`)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Numpy arrays of one step (shapes: T tokens, R requests, M page columns)."""

    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    seq_lens: np.ndarray  # [R] int32
    query_start_loc: np.ndarray  # [R + 1] int32
    page_table: np.ndarray  # [R, M] int32
    slot_mapping: np.ndarray  # [T] int32
    num_seqs: np.ndarray  # [] int32
    logits_indices: np.ndarray  # [L] int32: each request's last `num_logits` new tokens
    feed_rows: np.ndarray  # [T] int32: row of the previous step's sampled ids, or -1
    lora_slots: np.ndarray  # [T] int32: each token's adapter slot (0: none, and padding)
    image_rows: np.ndarray | None = None  # [T] int32: image embedding row or -1 (images)
    attend_until: np.ndarray | None = None  # [T] int32: last key position (Gemma 3 images)
    mrope_positions: np.ndarray | None = None  # [3, T] int32: M-RoPE rows (Qwen2.5-VL)
    state_rows: np.ndarray | None = None  # [R] int32: state slots, -1 padding (hybrid models)

    def metadata_fields(self) -> dict[str, np.ndarray]:
        """The fields of `AttentionMetadata`, by name (``image_rows`` only in a
        vision-language model's batches)."""
        names = ("seq_lens", "query_start_loc", "page_table", "slot_mapping", "num_seqs")
        names += ("lora_slots", "image_rows", "attend_until", "mrope_positions", "state_rows")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _check_fits(chunks: Sequence[SeqChunk], num_tokens: int, num_reqs: int, num_logits: int):
    total = sum(len(c.token_ids) for c in chunks)
    rows = sum(c.num_logits for c in chunks)
    if total > num_tokens or len(chunks) > num_reqs or rows > num_logits:
        raise ValueError(
            f"{len(chunks)} requests with {total} tokens ({rows} logits rows) do not fit "
            f"a bucket of {num_reqs} requests, {num_tokens} tokens and {num_logits} rows"
        )


def _pages(chunk: SeqChunk, r: int, seq_len: int, page_size: int, pages_per_req: int):
    pages = np.asarray(chunk.page_ids, np.int32)
    if len(pages) * page_size < seq_len or len(pages) > pages_per_req:
        raise ValueError(
            f"request {r}: {len(pages)} pages of {page_size} cannot hold {seq_len} "
            f"tokens (at most {pages_per_req} pages per request)"
        )
    return pages


def pack_batch(
    chunks: Sequence[SeqChunk],
    *,
    page_size: int,
    num_tokens: int,
    num_reqs: int,
    pages_per_req: int,
    num_logits: int | None = None,
    images: bool = False,
    both_ways: bool = False,
    mrope: bool = False,
    states: bool = False,
) -> PackedBatch:
    """Flattens ``chunks`` into arrays padded to ``num_tokens`` and ``num_reqs``; the
    logits rows (``num_logits``, default ``num_reqs``) follow the chunks' order. With
    ``image_rows`` when ``images`` (a vision-language model), ``attend_until`` when
    ``both_ways`` (image tokens attend both ways), ``mrope_positions`` when ``mrope`` (a
    chunk's own, else every row its ``positions``), ``state_rows`` when ``states``.
    Raises ValueError when the chunks do not fit or pages do not cover the tokens."""
    num_logits = num_reqs if num_logits is None else num_logits
    _check_fits(chunks, num_tokens, num_reqs, num_logits)
    token_ids, positions, lora_slots = np.zeros((3, num_tokens), np.int32)
    slot_mapping = np.full(num_tokens, NULL_PAGE * page_size, np.int32)
    seq_lens = np.zeros(num_reqs, np.int32)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    page_table = np.full((num_reqs, pages_per_req), NULL_PAGE, np.int32)
    logits_indices = np.zeros(num_logits, np.int32)
    start = row = 0
    for r, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        end = start + n
        seq_len = chunk.num_computed + n
        pages = _pages(chunk, r, seq_len, page_size, pages_per_req)
        pos = np.arange(chunk.num_computed, seq_len, dtype=np.int32)
        token_ids[start:end] = chunk.token_ids
        positions[start:end] = pos
        slot_mapping[start:end] = pages[pos // page_size] * page_size + pos % page_size
        seq_lens[r] = seq_len
        lora_slots[start:end] = chunk.lora_slot
        page_table[r, : len(pages)] = pages
        c = chunk.num_logits
        logits_indices[row : row + c] = np.maximum(np.arange(end - c, end), 0)
        row += c
        start = end
        query_start_loc[r + 1] = end
    query_start_loc[len(chunks) + 1 :] = start
    return PackedBatch(
        token_ids=token_ids,
        positions=positions,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        page_table=page_table,
        slot_mapping=slot_mapping,
        num_seqs=np.asarray(len(chunks), np.int32),
        logits_indices=logits_indices,
        feed_rows=np.full(num_tokens, -1, np.int32),
        lora_slots=lora_slots,
        **_image_fields(chunks, positions, images, both_ways, mrope),
        state_rows=_state_rows(chunks, num_reqs) if states else None,
    )


def _state_rows(chunks: Sequence[SeqChunk], num_reqs: int) -> np.ndarray:
    """``[R]``: each request's state slot, -1 for the padding requests."""
    rows = np.full(num_reqs, -1, np.int32)
    rows[: len(chunks)] = [c.state_row for c in chunks]
    return rows


def _image_fields(chunks, positions: np.ndarray, images: bool, both_ways: bool, mrope: bool):
    """The per-token fields of a vision-language model's batch (`pack_batch`)."""
    return dict(
        image_rows=_per_token(chunks, "image_rows", np.full(len(positions), -1, np.int32), images),
        attend_until=_per_token(chunks, "attend_until", positions.copy(), both_ways),
        mrope_positions=(
            _per_token(chunks, "mrope_positions", np.tile(positions, (3, 1)), True)
            if mrope
            else None
        ),
    )


def _per_token(chunks: Sequence[SeqChunk], name: str, base: np.ndarray, wanted: bool):
    """``base`` with each chunk's own ``name`` values over its tokens (None unless
    ``wanted``)."""
    if not wanted:
        return None
    start = 0
    for chunk in chunks:
        n, values = len(chunk.token_ids), getattr(chunk, name)
        if values is not None:
            base[..., start : start + n] = values
        start += n
    return base
