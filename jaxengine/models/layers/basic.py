"""Linear, embedding and RMSNorm layers with Hugging Face parameter names and layouts.

Weights keep the checkpoint's layout (`Linear.weight` is ``[out, in]``) so loading is a
rename, never a transpose; XLA contracts either layout at the same cost. Every
parameter carries logical axis names (`sharding/` maps them onto a mesh).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers import quant

_INIT_STD = 0.02


def _normal(std: float = _INIT_STD):
    return nn.initializers.normal(stddev=std)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight: [out, in]``.

    ``quant`` ("int8", "fp8"; `layers.quant`): ``weight`` holds quantized values and
    ``weight_scale: [out]`` their per-row float32 scales."""

    features: int
    axes: tuple[str, str]  # logical names of (out, in)
    use_bias: bool = False
    dtype: Any = jnp.float32
    quant: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        shape = (self.features, x.shape[-1])
        if self.quant is None:
            init = nn.with_logical_partitioning(_normal(), self.axes)
            weight = self.param("weight", init, shape, self.dtype)
            y = jax.lax.dot_general(x.astype(self.dtype), weight, (((x.ndim - 1,), (1,)), ((), ())))
        else:
            init = nn.with_logical_partitioning(nn.initializers.zeros, self.axes)
            weight = self.param("weight", init, shape, quant.weight_dtype(self.quant))
            ones = nn.with_logical_partitioning(nn.initializers.ones, self.axes[:1])
            scale = self.param(quant.scale_name("weight"), ones, shape[:1], jnp.float32)
            y = quant.quantized_linear(x, weight, scale, self.dtype)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[:1]),
                (self.features,),
                self.dtype,
            )
            y = y + bias
        return y


class Embed(nn.Module):
    """Token embedding ``weight: [vocab, H]``; `attend` gives tied-head logits."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32

    def setup(self) -> None:
        self.weight = self.param(
            "weight",
            nn.with_logical_partitioning(_normal(), ("vocab", "embed")),
            (self.num_embeddings, self.features),
            self.dtype,
        )

    def __call__(self, token_ids: jax.Array) -> jax.Array:  # [T] -> [T, H]
        return jnp.take(self.weight, token_ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:  # [N, H] -> [N, V]
        return jnp.dot(x.astype(self.dtype), self.weight.T)


class RMSNorm(nn.Module):
    """RMSNorm in float32; multiplies by ``offset + weight`` (offset 1.0 for Gemma)."""

    eps: float = 1e-6
    offset: float = 0.0
    dtype: Any = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        weight = self.param(
            "weight",
            nn.with_logical_partitioning(init, (self.axis_name,)),
            (x.shape[-1],),
            self.dtype,
        )
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (self.offset + weight.astype(jnp.float32))).astype(x.dtype)


def activation(name: str):
    """The HF activation named ``name`` as a jnp function."""
    table = {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(table)}")
    return table[name]
