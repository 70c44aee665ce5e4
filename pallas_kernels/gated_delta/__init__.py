"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule and its short causal
convolution over a ragged batch, with per-request recurrent state.

`reference.py` is the definition (pure jnp, jittable, the CPU path): the recurrent
form, the chunked form and the convolution. `tpu.py` (Mosaic) and `gpu.py` (Triton)
run `reference.gated_delta_rule`'s signature (the state pool and each request's row
in, the updated pool out) as one kernel for mixed batches; `chunk.py` holds the chunk
step both kernels compute.
"""

from pallas_kernels.gated_delta.reference import causal_conv1d, gated_delta_rule

__all__ = ["causal_conv1d", "gated_delta_rule"]
