"""Ragged paged attention: one call for a mixed batch of decodes and prefill chunks.

`reference.py` is the definition (pure jnp, jittable, used on CPU). Pallas versions for
TPU and GPU share its signature.
"""

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention,
    update_kv_cache,
)

__all__ = ["ragged_paged_attention", "update_kv_cache"]
