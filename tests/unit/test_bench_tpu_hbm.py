"""`bench.tpu_hbm`: the per-operation breakdown adds up to tpu-check's HBM count and
names every layer's operations alike (on a CPU-compiled program: the HLO text and the
count are the same code as on TPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.tpu_hbm import by_operation
from jaxengine.tpu_check import hlo


def test_breakdown_sums_to_the_count_and_merges_layers():
    def layers_3(x, w):
        return jnp.tanh(x @ w)

    def step(x, w1, w2):
        with jax.named_scope("layers_3"):
            y = layers_3(x, w1)
        with jax.named_scope("layers_7"):
            return jnp.tanh(y @ w2)

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    text = jax.jit(step).lower(x, w, w).compile().as_text()
    rows = by_operation(text)
    assert sum(r[0] for r in rows) == hlo.hbm_bytes(hlo.parse(text))
    assert not any("layers_" in key for *_, key in rows)
    assert any(key.startswith("L/") for *_, key in rows)
