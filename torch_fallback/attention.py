"""Paged attention for transformers' PyTorch models, on the engine's own KV pages.

`register()` adds ``"jaxengine_paged"`` to transformers' `AttentionInterface` (and a
mask function that builds no mask: the pages and positions say what each query
sees). A model set to it runs one flat token batch (``[1, T]``, the requests'
tokens back to back, as the JAX runner packs them). Each attention layer then:

1. writes the batch's k and v into the layer's pages at ``slot_mapping`` (the cache
   is ``[pages, page_size, 2 * Hkv, D]`` with k and v of a head side by side, the
   JAX cache's layout, so the KV manager's accounting and page swaps are the same);
2. for each request, reads its ``seq_len`` positions back from its pages and attends
   its queries (the last ``n`` positions) causally, sliding window and soft cap as
   the model passes them.

The step's metadata reaches the layers through `current` (set around one forward by
`TorchProgram.step`), not through the model's signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

NAME = "jaxengine_paged"
_state = threading.local()


@dataclasses.dataclass
class PagedStep:
    """One forward's pages and where its tokens go: ``slot_mapping [T]`` and, per
    request, ``(first token, end token, seq_len, its page ids)``."""

    caches: list[torch.Tensor]  # per layer [P, S, 2 * Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64
    requests: list[tuple[int, int, int, torch.Tensor]]

    @classmethod
    def of(cls, caches: list, batch: Any, num_tokens: int, device: Any) -> PagedStep:
        """The step of a `PackedBatch`'s first ``num_tokens`` (its real ones)."""
        page_size = caches[0].shape[1]
        requests = []
        for r in range(int(batch.num_seqs)):
            start, end = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
            length = int(batch.seq_lens[r])
            pages = np.asarray(batch.page_table[r, : -(-length // page_size)])
            requests.append((start, end, length, torch.as_tensor(pages, device=device)))
        slots = np.asarray(batch.slot_mapping[:num_tokens], np.int64)
        return cls(caches, torch.as_tensor(slots, device=device), requests)


@contextlib.contextmanager
def current(step: PagedStep) -> Iterator[None]:
    previous = getattr(_state, "step", None)
    _state.step = step
    try:
        yield
    finally:
        _state.step = previous


def paged_attention(
    module: Any,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ``[1, T, Hq, D]``."""
    step: PagedStep = _state.step
    cache = step.caches[module.layer_idx]
    pages, page_size, _, head_dim = cache.shape
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    kv = torch.stack([k, v], dim=2).reshape(k.shape[0], -1, head_dim).to(cache.dtype)
    cache.view(pages * page_size, -1, head_dim)[step.slot_mapping] = kv
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.zeros_like(q)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    for start, end, length, ids in step.requests:
        held = cache[ids].reshape(-1, cache.shape[2], head_dim)[:length].to(q.dtype)
        out[start:end] = _attend(q[start:end], held, scale, window, softcap)
    return out.unsqueeze(0), None


def _attend(q: torch.Tensor, held: torch.Tensor, scale: float, window, softcap) -> torch.Tensor:
    """``q [n, Hq, D]`` (the last ``n`` of ``L`` positions) over ``held [L, 2 * Hkv, D]``."""
    n, num_heads, _ = q.shape
    length = held.shape[0]
    k, v = held[:, 0::2], held[:, 1::2]  # [L, Hkv, D]
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k).float() * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(length - n, length).unsqueeze(1)
    kpos = torch.arange(length).unsqueeze(0)
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register() -> None:
    """Makes ``attn_implementation="jaxengine_paged"`` available (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
