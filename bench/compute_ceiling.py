"""The machine's matmul ceiling for embedding work, measured in the run.

An embedding model runs each prompt whole, once, with no decode, so its projections
(attention q/k/v/o and the MLP) are nearly all of its arithmetic, and no engine can
embed faster than the machine runs those products. This module counts the
projections' FLOPs per token from the model's ``config.json`` and times them where the
benchmark runs: a jitted function of one layer's products on a step of ``tokens`` rows
(the engine's CPU token budget), in the engine's dtypes as `layers.basic.Linear`
computes them (float32; or the activations cast to bfloat16 against bfloat16 weights,
accumulated in float32), best of ``repeats``. Then

    ceiling sentences/s = sentences * dot FLOP/s / (their tokens * FLOPs per token)

with the sentences' own tokens, no padding. `bench.embed` measures it after each round
of the peers (the machine's rate drifts between rounds) and prints it beside them:
a peer that embeds faster than half the ceiling cannot be beaten 2x on this machine in
that dtype, whatever the engine does around the products. Attention's own products
(``4 * len * hidden`` per token and layer, under 1% of the projections' for 17-token
sentences on all-MiniLM-L6-v2) are left out, so the ceiling is a little high.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxengine.config.scheduler import CPU_DEFAULTS  # host code: no jax import

STEP_TOKENS = CPU_DEFAULTS[1]  # the engine's token budget per step on CPU


@dataclass(frozen=True)
class Ceiling:
    sentences: int
    tokens: int  # the sentences' own tokens, special tokens included
    flops_per_token: int
    dot_flops_per_s: float
    dtype: str  # of the products' inputs

    @property
    def sentences_per_s(self) -> float:
        return self.sentences * self.dot_flops_per_s / (self.tokens * self.flops_per_token)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "flops_per_token": self.flops_per_token,
            "dot_gflop_per_s": self.dot_flops_per_s / 1e9,
            "dtype": self.dtype,
            "ceiling_sentences_per_s": self.sentences_per_s,
        }


def projection_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """One layer's projection weights as ``(out, in)``: q, k, v, o, then the MLP (up
    and down for BERT's; gate, up and down for the decoders' gated MLPs)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    mlp = [(inter, hidden), (hidden, inter)]
    if config.get("model_type") != "bert":
        mlp.insert(0, (inter, hidden))
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), *mlp]


def flops_per_token(config: dict[str, Any]) -> int:
    """The projections' FLOPs for one token through every layer."""
    per_layer = sum(2 * out * inp for out, inp in projection_shapes(config))
    return per_layer * config["num_hidden_layers"]


def dot_timer(
    shapes: list[tuple[int, int]],
    dtype: str,
    tokens: int = STEP_TOKENS,
    input_dtype: str = "float32",
) -> Callable[[int], float]:
    """A function of ``repeats`` giving the FLOP/s (best of that many runs) of a jitted
    function computing ``x @ w.T`` for each ``(out, in)`` weight of ``shapes`` on
    ``tokens`` rows stored in ``input_dtype``, the weights stored in ``dtype`` and the
    rows cast to it, accumulated in float32. It is compiled here, once. With
    ``input_dtype == dtype`` nothing is cast: the products alone (a peak rate)."""
    import jax
    import jax.numpy as jnp

    arrays = [(s, dtype) for s in shapes] + [((tokens, s[1]), input_dtype) for s in shapes]
    sizes = [math.prod(shape) for shape, _ in arrays]

    @jax.jit
    def draw(key):  # one normal draw sliced: XLA:CPU compiles one RNG, not two per shape
        flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
        ends = itertools.accumulate(sizes)
        return [
            flat[end - n : end].reshape(shape).astype(dt)
            for (shape, dt), n, end in zip(arrays, sizes, ends, strict=True)
        ]

    drawn = draw(jax.random.PRNGKey(0))
    weights, inputs = drawn[: len(shapes)], drawn[len(shapes) :]
    dims = (((1,), (1,)), ((), ()))
    flops = sum(2 * tokens * out * inp for out, inp in shapes)

    @jax.jit
    def products(xs, ws):
        return [
            jax.lax.dot_general(x.astype(dtype), w, dims, preferred_element_type=jnp.float32)
            for x, w in zip(xs, ws, strict=True)
        ]

    def rate(repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(products(inputs, weights))
            best = min(best, time.perf_counter() - start)
        return flops / best

    jax.block_until_ready(products(inputs, weights))
    return rate


def ceiling_meter(
    config: dict[str, Any], token_counts: list[int], dtype: str, repeats: int = 7
) -> Callable[[], Ceiling]:
    """A function that measures the ceiling now for sentences of ``token_counts`` tokens
    on the model of ``config``, its products' inputs in ``dtype`` (``float32`` or
    ``bfloat16``). Call it beside each round of the peers: the machine's rate drifts."""
    rate = dot_timer(projection_shapes(config), dtype)
    fixed = (len(token_counts), sum(token_counts), flops_per_token(config))
    return lambda: Ceiling(*fixed, rate(repeats), dtype)
