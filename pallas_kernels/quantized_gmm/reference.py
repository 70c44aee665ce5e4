"""Reference of the quantized grouped matmuls: the experts dequantized whole, then
XLA's `jax.lax.ragged_dot`; and the decodings the kernel shares (`e2m1`, `e8m0`;
`dequantize_mxfp4`, `dequantize_fp8`).

Contract (the Pallas TPU kernels `tpu.mxfp4_ragged_dot` and `tpu.fp8_ragged_dot`
have the same signatures):

- ``x [R, K]``: rows sorted by expert; rows ``offsets[g] .. offsets[g] + sizes[g]``
  belong to local expert ``g`` (``offsets`` the exclusive cumulative sum of
  ``group_sizes``); rows after the last group belong to none.
- MXFP4 (gpt-oss): ``packed [G, K / 2, N]`` uint8: e2m1 codes, input column ``2k``
  in the low nibble of byte row ``k``, ``2k + 1`` in the high one
  (`jaxengine.models.layers.quant`'s transposed ``mxfp4`` leaf); ``scales [G, K /
  32, N]`` uint8 e8m0 exponents, one per 32 input columns.
- Block fp8 (DeepSeek-V3): ``values [G, K, N]`` float8_e4m3fn and ``scales [G, K /
  g, N]`` float32, one per ``g`` input columns (``g`` divides ``K``; the transposed
  grouped ``fp8`` leaves): ``w = values * scale``.
- Returns ``[R, N]`` in ``x``'s dtype: row ``r`` of group ``g`` is ``x[r] @ W_g``,
  the weight rounded to ``x``'s dtype, accumulated in float32. Rows of no group are
  zeros here; the kernel leaves them unspecified (its callers mask them).

The kernel rounds the same float32 products to ``x``'s dtype (for MXFP4 exact in
bfloat16: an e2m1 value has two significant bits and the e8m0 scale is a power of
two), so the kernel and this reference differ only in the order of the float32
accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
"""Input columns per e8m0 exponent."""


def e2m1(codes: Any, xp: Any = jnp) -> Any:
    """float32 values of 4-bit e2m1 ``codes`` (any int array, 0..15): bit 3 the sign,
    bits 1-2 the exponent ``e``, bit 0 the mantissa ``m``: ``m / 2`` at ``e`` 0, else
    ``(1 + m / 2) * 2^(e - 1)``. By arithmetic, not a table lookup (XLA makes a lookup
    a gather; Mosaic has none)."""
    exp_bits = (codes >> 1) & 3
    half = (codes & 1).astype(xp.float32) * 0.5
    power = xp.where(exp_bits == 3, 4.0, xp.where(exp_bits == 2, 2.0, 1.0))
    magnitude = xp.where(exp_bits == 0, half, (1.0 + half) * power).astype(xp.float32)
    return xp.where(codes >= 8, -magnitude, magnitude)


def e8m0(exponents: Any, xp: Any = jnp) -> tuple[Any, Any]:
    """``2^(s - 127)`` of e8m0 bytes ``s`` (any int array, 0..255) as two float32
    factors built from their bits, each a normal number (at most ``2^64``), so that a
    value times both is what ``ldexp`` gives, where one factor ``2^-127`` would be a
    subnormal that XLA flushes to zero (255 gives ``2^128``: infinity times a value)."""
    e = exponents.astype(xp.int32) - 127
    low = e >> 1  # floor(e / 2), a shift (Mosaic lowers // through sign())
    return tuple(_power_of_two(p, xp) for p in (low, e - low))


def _power_of_two(p: Any, xp: Any) -> Any:
    bits = ((p + 127) << 23).astype(xp.int32)  # -63 <= p <= 64: a normal float32
    if xp is np:
        return bits.view(np.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize_mxfp4(packed: Any, scales: Any, xp: Any = jnp) -> Any:
    """float32 ``[..., K, N]`` of ``packed [..., K / 2, N]`` and ``scales [..., K / 32,
    N]`` (the transposed layout of the module docstring)."""
    codes = xp.asarray(packed).astype(xp.int32)
    values = xp.stack([e2m1(codes & 15, xp), e2m1(codes >> 4, xp)], axis=-2)  # [.., K/2, 2, N]
    *lead, half, _, n = values.shape
    values = values.reshape(*lead, half * 2 // BLOCK, BLOCK, n)
    low, high = (f[..., None, :] for f in e8m0(xp.asarray(scales), xp))  # [.., K/32, 1, N]
    return (values * low * high).reshape(*lead, half * 2, n)


def mxfp4_ragged_dot(
    x: jax.Array,  # [R, K]
    packed: jax.Array,  # [G, K / 2, N] uint8
    scales: jax.Array,  # [G, K / 32, N] uint8
    group_sizes: jax.Array,  # [G] int32
) -> jax.Array:
    """``x``'s rows times their expert's dequantized weight (module docstring)."""
    return _ragged_dot(x, dequantize_mxfp4(packed, scales).astype(x.dtype), group_sizes)


def dequantize_fp8(values: Any, scales: Any, xp: Any = jnp) -> Any:
    """float32 ``[..., K, N]`` of fp8 ``values [..., K, N]`` and float32 group
    ``scales [..., K / g, N]`` (the transposed layout of the module docstring): each
    value times its group's scale, as `jaxengine.models.layers.quant.dequantize`."""
    q = xp.asarray(values).astype(xp.float32)
    *lead, k, n = q.shape
    groups = scales.shape[-2]
    if k % groups:
        raise ValueError(f"{k} input rows do not split into {groups} groups")
    grouped = q.reshape(*lead, groups, k // groups, n)  # [..., K/g, g, N]
    return (grouped * xp.asarray(scales, dtype=xp.float32)[..., None, :]).reshape(q.shape)


def fp8_ragged_dot(
    x: jax.Array,  # [R, K]
    values: jax.Array,  # [G, K, N] float8_e4m3fn
    scales: jax.Array,  # [G, K / g, N] float32
    group_sizes: jax.Array,  # [G] int32
) -> jax.Array:
    """``x``'s rows times their expert's dequantized weight (module docstring)."""
    return _ragged_dot(x, dequantize_fp8(values, scales).astype(x.dtype), group_sizes)


def _ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    y = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
