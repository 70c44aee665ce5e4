"""Weight-only int8 / fp8 matmul: ``x @ (w * scale[:, None]).T`` with ``w [N, K]``
8-bit in the engine's ``[out, in]`` layout and one float32 scale per output row.

`reference.py` is the definition (pure jnp; XLA's dot on the weight converted, the
path of every platform but CUDA). `gpu.py` (Triton) reads the 8-bit tiles and widens
them in registers, for skinny activations (decode). `quantized_matmul` here picks, in
one place, at trace time: the kernel when lowered for CUDA with at most
`gpu.MAX_ROWS` rows, shapes it tiles, and a weight no GSPMD mesh splits; the
reference otherwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import gpu, reference

__all__ = ["quantized_matmul", "uses_kernel"]


def quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., K] @ (w * scale[:, None]).T`` -> ``[..., N]`` in ``x``'s dtype
    (`reference.quantized_matmul`), by the GPU kernel where `uses_kernel` says so and
    the program is lowered for CUDA (`jax.lax.platform_dependent`), else the reference."""
    reference.check_shapes(x, w, scale)
    if not uses_kernel(x, w):
        return reference.quantized_matmul(x, w, scale)
    rows = math.prod(x.shape[:-1])

    def kernel(x, w, scale):  # [..., K] as [rows, K]
        y = gpu.quantized_matmul(x.reshape(rows, x.shape[-1]), w, scale)
        return y.reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(x, w, scale, cuda=kernel, default=reference.quantized_matmul)


def uses_kernel(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [..., K] @ w [N, K].T`` runs the GPU kernel when lowered for CUDA:
    at most `gpu.MAX_ROWS` rows (decode; XLA's GEMMs keep prefill), shapes the kernel
    tiles (`gpu.unsupported`), GPUs that take its dtype (`_local_gpus_take`), and a
    weight on one device or under ``shard_map``. A
    weight that a GSPMD mesh of more than one device may split (tensor parallelism
    under plain ``jit``) keeps XLA's dot, which the partitioner splits; it cannot
    split a Pallas call, and would gather the whole weight to every device for it."""
    rows = math.prod(x.shape[:-1])
    if gpu.unsupported(rows, x.shape[-1], w.shape[0]) is not None:
        return False
    if not _local_gpus_take(jnp.dtype(w.dtype)):
        return False
    mesh = jax.typeof(w).sharding.mesh
    return all(
        size == 1 or kind == jax.sharding.AxisType.Manual
        for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
    )


@functools.cache
def _local_gpus_take(weight_dtype: jnp.dtype) -> bool:
    """Whether this process's CUDA GPUs, if it has any, run the kernel on weights of
    ``weight_dtype``: bfloat16 dots need compute capability 8.0 (Ampere), Triton's
    float8_e4m3fn 8.9 (Ada, Hopper). Without a CUDA device (lowering on a CPU host
    for a GPU) the target is assumed to take it."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend here
        return True
    need = 8.9 if weight_dtype == jnp.dtype(jnp.float8_e4m3fn) else 8.0
    return all(float(getattr(d, "compute_capability", need)) >= need for d in devices)
