"""Linear, embedding, RMSNorm and LayerNorm layers with Hugging Face names and layouts.

Weights keep the checkpoint's layout (`Linear.weight` is ``[out, in]``) so loading is a
rename, never a transpose; XLA contracts either layout at the same cost. Every
parameter carries logical axis names (`sharding/` maps them onto a mesh).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers import quant
from jaxengine.models.layers.lora import LoRASpec, lora_delta

_INIT_STD = 0.02


def float32_dots(method):
    """Traces a module method with full-float32 dots when its ``config.dtype`` is
    float32. XLA's default precision runs float32 dots as TF32 on GPUs (about 1e-3
    relative error), where torch keeps full float32: a float32 model is asked for
    float32 arithmetic. Other dtypes, and float32 models whose projections run in
    another ``matmul_dtype`` (``--dtype bfloat16`` on CPU), are traced as they are."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with matmul_precision(self.config):
            return method(self, *args, **kwargs)

    return wrapped


def matmul_precision(cfg: Any) -> contextlib.AbstractContextManager:
    """`float32_dots`'s context for a model of config ``cfg``: full-float32 dots for a
    float32 model, nothing otherwise."""
    matmul = cfg.dtype if cfg.matmul_dtype is None else cfg.matmul_dtype
    if jnp.dtype(cfg.dtype) != jnp.float32 or jnp.dtype(matmul) != jnp.float32:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("float32")


def _normal(std: float = _INIT_STD):
    return nn.initializers.normal(stddev=std)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight: [out, in]``.

    ``quant`` (a `layers.quant.QuantScheme`): ``weight`` holds quantized values and
    ``weight_scale`` (and the scheme's other leaves) how to scale them; a scheme for
    the MoE experts only (``mxfp4``, `quant.QuantScheme.experts_only`) leaves this
    weight in the model dtype. ``lora`` (a
    `layers.lora.LoRASpec`): adapter slots ``lora_a``/``lora_b``, applied per token
    by ``lora_slots [T]`` when given (`layers.lora.lora_delta`). ``weight_dtype``
    (`TransformerConfig.matmul_dtype`): an unquantized weight is stored in it and ``x``
    is cast to it for the dot, which accumulates in ``dtype``; None: ``dtype``."""

    features: int
    axes: tuple[str, str]  # logical names of (out, in)
    use_bias: bool = False
    dtype: Any = jnp.float32
    quant: quant.QuantScheme | None = None
    lora: LoRASpec | None = None
    weight_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        shape = (self.features, x.shape[-1])  # x: [T, in] -> [T, out]
        scheme = self.quant
        if scheme is not None and (scheme.experts_only or not quantizes(scheme, self)):
            scheme = None
        if scheme is None:
            init = nn.with_logical_partitioning(_normal(), self.axes)
            wdtype = self.weight_dtype or self.dtype
            weight = self.param("weight", init, shape, wdtype)
            out = None if jnp.dtype(wdtype) == jnp.dtype(self.dtype) else self.dtype
            dims = (((x.ndim - 1,), (1,)), ((), ()))
            y = jax.lax.dot_general(x.astype(wdtype), weight, dims, preferred_element_type=out)
        else:
            leaves = quantized_params(self, "weight", shape, self.axes, scheme)
            y = quant.quantized_linear(x, leaves, scheme, self.dtype)
        if self.lora is not None:
            a, b = lora_params(self, shape, self.axes, self.lora)
            if lora_slots is not None:
                y = y + lora_delta(x, lora_slots, a, b, self.lora.max_loras).astype(y.dtype)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[:1]),
                (self.features,),
                self.dtype,
            )
            y = y + bias
        return y


def quantizes(scheme: quant.QuantScheme, module: nn.Module, child: str = "") -> bool:
    """Whether ``scheme`` stores ``module``'s weights (or those of its ``child``
    parameter group): not where the checkpoint keeps that module unquantized
    (`quant.QuantScheme.quantizes`). Inside a decoder layer the module is named from
    the layer (``mlp.gate_proj``: a layer runs as its own module too,
    `layers.decoder.run_layers`), against the layer's scheme (`LayerSpec.unquantized`)."""
    if not scheme.unquantized:
        return True
    path = [*module.scope.path, child] if child else list(module.scope.path)
    layer = max((i for i, p in enumerate(path) if _LAYER_NAME.match(p)), default=-1)
    return scheme.quantizes(".".join(path[layer + 1 :]))


_LAYER_NAME = re.compile(r"^layers_\d+$")


def quantized_params(
    module: nn.Module,
    name: str,
    shape: tuple,
    axes: tuple,
    scheme: quant.QuantScheme,
    transpose: bool = False,
) -> dict:
    """Declares the leaves storing float weight ``name`` of ``shape [..., out, in]``
    under ``scheme`` (`quant.leaf_specs`: ``name`` and its ``_scale``...; ``transpose``:
    stored ``[..., in, out]``) on ``module``; returns them by suffix. They start at zero
    (scales at one): a checkpoint or dummy fill replaces them."""
    leaves = {}
    specs = quant.leaf_specs(scheme, shape, axes, transpose)
    for suffix, (leaf_shape, dtype, leaf_axes) in specs.items():
        fill = nn.initializers.ones if suffix == "_scale" else nn.initializers.zeros
        init = nn.with_logical_partitioning(fill, leaf_axes)
        leaves[suffix] = module.param(name + suffix, init, leaf_shape, dtype)
    return leaves


def lora_params(module: nn.Module, shape: tuple, axes: tuple, spec: LoRASpec):
    """Declares the adapter slots of a ``[out, in]`` weight: ``lora_a [in, L*r]`` and
    ``lora_b [L*r, out]`` (`layers.lora`), zero until adapters are written in. A's
    slot columns are split over the tensor axis only with ``fully_sharded`` and an
    unsplit input (a column-parallel projection; `sharding.rules`)."""
    (out, inp), (out_axis, in_axis) = shape, axes
    width = spec.max_loras * spec.max_rank
    rank_axis = "lora_rank" if spec.fully_sharded and in_axis == "embed" else None
    a_init = nn.with_logical_partitioning(nn.initializers.zeros, (in_axis, rank_axis))
    b_init = nn.with_logical_partitioning(nn.initializers.zeros, ("lora", out_axis))
    a = module.param("lora_a", a_init, (inp, width), spec.dtype)
    b = module.param("lora_b", b_init, (width, out), spec.dtype)
    return a, b


class Embed(nn.Module):
    """Token embedding ``weight: [vocab, H]``; `attend` gives tied-head logits.

    ``axes`` names the table's (rows, H) axes: a small table that should not be split
    (BERT's positions and token types) passes ``(None, "embed")``."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    axes: tuple[str | None, str] = ("vocab", "embed")

    def setup(self) -> None:
        self.weight = self.param(
            "weight",
            nn.with_logical_partitioning(_normal(), self.axes),
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


class LayerNorm(nn.Module):
    """LayerNorm in float32 over the last axis: ``(x - mean) / std * weight + bias``."""

    eps: float = 1e-12
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1],)
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        zeros = nn.with_logical_partitioning(nn.initializers.zeros, ("norm",))
        weight = self.param("weight", ones, shape, self.dtype)
        bias = self.param("bias", zeros, shape, self.dtype)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


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
