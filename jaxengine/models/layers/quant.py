"""Weight-only quantization: int8 or float8 weights, one float scale per output channel.

``--quantization int8`` stores each linear weight ``[out, in]`` as int8 with a
symmetric per-row scale (``w ~= q * scale[:, None]``, ``|q| <= 127``);
``--quantization fp8`` as float8_e4m3fn with ``|q| <= 448`` (vLLM's dynamic fp8,
weights only). The scale is per output channel, so it commutes with the dot:
``x @ (q * s).T == (x @ q.T) * s``. `quantized_linear` computes the right side (the
weight converted to the activation dtype inside the matmul, the scale applied to
the ``[T, out]`` result), `dequantize` is its reference (the left side).

`quantize` is the one quantizer, for numpy (the loader, host side) and jnp (dummy
weights, on device) alike: pass the array module as ``xp``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

METHODS = {"int8": (jnp.dtype(jnp.int8), 127.0), "fp8": (jnp.dtype(jnp.float8_e4m3fn), 448.0)}
"""Method -> (storage dtype, largest magnitude it holds)."""


def scale_name(weight_name: str) -> str:
    """The parameter holding the per-row scales of quantized parameter ``weight_name``."""
    return f"{weight_name}_scale"


def weight_dtype(method: str) -> Any:
    return METHODS[method][0]


def is_quantized(dtype: Any) -> bool:
    """Whether a parameter of ``dtype`` holds quantized values (with a sibling scale)."""
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d, _ in METHODS.values())


def method_of(dtype: Any) -> str:
    return next(m for m, (d, _) in METHODS.items() if jnp.dtype(dtype) == jnp.dtype(d))


def quantize(weight: Any, method: str, xp: Any) -> tuple[Any, Any]:
    """``(q, scale)`` of ``weight [..., out, in]``: one float32 scale per output row
    (``[..., out]``), the largest magnitude of the row mapped to the format's largest.
    ``xp`` is numpy or jax.numpy."""
    dtype, largest = METHODS[method]
    w = xp.asarray(weight, dtype=xp.float32)
    amax = xp.max(xp.abs(w), axis=-1)  # [..., out]
    scale = xp.where(amax > 0, amax / largest, 1.0).astype(xp.float32)
    scaled = xp.clip(w / scale[..., None], -largest, largest)
    if method == "int8":
        scaled = xp.round(scaled)
    return scaled.astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 weight ``q * scale`` (the reference of `quantized_linear`)."""
    return q.astype(jnp.float32) * scale[..., None]


def quantized_linear(x: jax.Array, q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x [T, in] @ dequantize(q, scale).T`` -> ``[T, out]`` in ``dtype``: the dot on the
    weight converted to ``dtype``, then the per-row scale on the result."""
    y = jax.lax.dot_general(x.astype(dtype), q.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())))
    return y * scale.astype(dtype)
