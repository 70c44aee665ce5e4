"""Writing new tokens' K and V into their pages of the paged KV cache.

`reference.py` (XLA scatter, used on CPU) defines it; the Pallas versions for TPU and
GPU share its signature and write only the slots named, in place.
"""

from pallas_kernels.kv_cache_update.reference import update_kv_cache

__all__ = ["update_kv_cache"]
