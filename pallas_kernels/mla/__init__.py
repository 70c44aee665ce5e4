"""Ragged paged multi-head latent attention (DeepSeek-V2/V3), absorbed form.

`reference.py` is the definition (pure jnp, jittable; the CPU path): `ragged_paged_mla`
over a cache of one latent row a token, and `update_mla_cache`, its write. `tpu.py`
(Mosaic; its write is the reference's) and `gpu.py` (Triton, the write too) share
their signatures; `cost.py` bounds a call's flops and bytes.
"""

from pallas_kernels.mla.reference import ragged_paged_mla, update_mla_cache

__all__ = ["ragged_paged_mla", "update_mla_cache"]
