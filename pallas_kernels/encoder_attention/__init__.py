"""Bidirectional attention for encoders over the step's own keys, requests padded.

An encoder request (BERT) is scheduled whole, with no cached prefix, so every key it
attends to was computed in the same step. `padded.py` gathers each request's tokens
into a row of ``max_len`` slots and runs dense attention per row; `encoder_attention`
picks it inside the compiled step when the step's requests are short and whole, and
the paged kernel (``causal=False``) otherwise. The definition both must match is
`pallas_kernels.ragged_paged_attention.reference` with ``causal=False``.
"""

from pallas_kernels.encoder_attention.padded import encoder_attention, padded_attention

__all__ = ["encoder_attention", "padded_attention"]
