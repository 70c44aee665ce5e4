"""The weight-only int8 / fp8 matmul, defined: the spec of `gpu.quantized_matmul` and
the path every platform but CUDA runs (`layers.quant.quantized_linear`'s per-row
int8/fp8 case, unchanged).

The weight keeps the engine's layout, the checkpoint's ``[out, in]`` (``w [N, K]``,
`layers.basic.Linear`), with one float32 scale per output row (``scale [N]``): the
float weight is ``w * scale[:, None]``. Per-row scales commute with the dot, so the
dot runs on the 8-bit values converted to ``x``'s dtype and the scale multiplies the
``[M, N]`` result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
"""What the 8-bit weight may hold: int8 (``|q| <= 127``) or float8_e4m3fn; both are
exact in bfloat16, so the conversion loses nothing."""


def check_shapes(x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    """Raises a ValueError naming what is wrong with ``x [..., K]``, ``w [N, K]`` (int8
    or float8_e4m3fn) and ``scale [N]``."""
    if w.ndim != 2 or scale.ndim != 1 or x.ndim < 1:
        raise ValueError(f"want x [..., K], w [N, K], scale [N]: got {x.shape}, "
                         f"{w.shape}, {scale.shape}")  # fmt: skip
    if x.shape[-1] != w.shape[1] or scale.shape[0] != w.shape[0]:
        raise ValueError(f"x {x.shape}, w {w.shape} and scale {scale.shape} do not agree: "
                         "x [..., K], w [N, K], scale [N]")  # fmt: skip
    if jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {w.dtype}: want int8 or float8_e4m3fn")
    if not jnp.issubdtype(x.dtype, jnp.floating) or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"x ({x.dtype}) and scale ({scale.dtype}) must be floating point")


def quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., K] @ (w * scale[:, None]).T`` -> ``[..., N]`` in ``x``'s dtype.

    ``w [N, K]`` int8 or float8_e4m3fn, ``scale [N]`` (float32). XLA's dot of
    bfloat16 operands accumulates in float32 (CPU, GPU and TPU alike) and rounds the
    result to bfloat16; the scale, cast to ``x``'s dtype, multiplies that (exactly
    `layers.quant.quantized_linear`'s expression before the kernel existed). The
    kernel scales its float32 sums before rounding once: within a rounding of this."""
    check_shapes(x, w, scale)
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x, w.astype(x.dtype), contract)  # [..., N]
    return y * scale.astype(x.dtype)
