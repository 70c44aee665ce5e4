"""Bidirectional attention for encoders: over the step's own keys, requests padded
(BERT), and within segments of one sequence (vision towers).

An encoder request (BERT) is scheduled whole, with no cached prefix, so every key it
attends to was computed in the same step. `padded.py` gathers each request's tokens
into a row of ``max_len`` slots and runs dense attention per row; `encoder_attention`
picks it inside the compiled step when the step's requests are short and whole, and
the paged kernel (``causal=False``) otherwise. The definition both must match is
`pallas_kernels.ragged_paged_attention.reference` with ``causal=False``.

A vision tower's rows attend within their segment (a window, an image): `segments.py`
holds the dense definition, `segment_attention_reference`, and the two forms whose
memory grows linearly with the rows, `window_attention` (short contiguous segments)
and `blocked_segment_attention` (any segments, query blocks against all keys).
"""

from pallas_kernels.encoder_attention.padded import encoder_attention, padded_attention
from pallas_kernels.encoder_attention.segments import (
    blocked_segment_attention,
    segment_attention_reference,
    window_attention,
)

__all__ = [
    "blocked_segment_attention",
    "encoder_attention",
    "padded_attention",
    "segment_attention_reference",
    "window_attention",
]
