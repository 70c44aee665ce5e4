"""Bidirectional attention for encoders over the step's own keys, in fixed windows.

An encoder request (BERT) is scheduled whole, with no cached prefix, so every key it
attends to was computed in the same step and lies next to its queries in the flat
token layout. `windowed.py` exploits that: each tile of ``block_q`` queries attends to
a window of the step's keys that reaches ``max_len - 1`` tokens to either side, masked
to the query's own request. `encoder_attention` picks, inside one compiled program,
the smallest window that covers the step's longest request, and falls back to the
paged kernel (``causal=False``) for longer requests or a cached prefix. The
definition it must match is `pallas_kernels.ragged_paged_attention.reference` with
``causal=False``.
"""

from pallas_kernels.encoder_attention.windowed import encoder_attention, windowed_attention

__all__ = ["encoder_attention", "windowed_attention"]
