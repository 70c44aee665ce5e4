"""Ragged paged attention: one call for a mixed batch of decodes and prefill chunks.

`reference.py` is the definition (pure jnp, jittable). `cpu.py` (plain JAX laid out
request-major for XLA's CPU backend, the CPU default), `tpu.py` (Mosaic) and `gpu.py`
(Triton) share its signature; `cost.py` counts their flops and bytes.
"""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
