"""Ragged paged multi-head latent attention (DeepSeek-V2/V3), absorbed form.

`reference.py` is the definition (pure jnp, jittable; the CPU path and, until MLA
kernels exist, every platform's): `ragged_paged_mla` over a cache of one latent row a
token, and `update_mla_cache`, its write.
"""

from pallas_kernels.mla.reference import ragged_paged_mla, update_mla_cache

__all__ = ["ragged_paged_mla", "update_mla_cache"]
