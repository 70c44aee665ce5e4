"""A float32 model traces full-float32 dots; other dtypes keep XLA's default.

XLA runs float32 dots at its default precision as TF32 on GPUs (about 1e-3 relative
error, which failed the golden tests there); `layers.basic.float32_dots` asks for
float32. The choice is visible in the traced program, so this runs on any backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxengine.models import llama
from tests.tiny_models import tiny_llama_config


def dot_precisions(dtype, matmul_dtype=None) -> set:
    cfg = llama.from_hf(tiny_llama_config(64), dtype)
    cfg = dataclasses.replace(cfg, matmul_dtype=matmul_dtype)
    module = llama.LlamaForCausalLM(cfg)
    hidden = jnp.ones((3, cfg.hidden_size), dtype)
    params = module.init(jax.random.key(0), hidden, method="compute_logits")
    jaxpr = jax.make_jaxpr(lambda p, h: module.apply(p, h, method="compute_logits"))(params, hidden)
    return {str(e.params["precision"]) for e in jaxpr.eqns if e.primitive.name == "dot_general"}


@pytest.mark.parametrize(
    "dtype, matmul_dtype, want",
    [
        (jnp.float32, None, {"(Precision.HIGHEST, Precision.HIGHEST)"}),
        (jnp.bfloat16, None, {"None"}),
        (jnp.float32, jnp.bfloat16, {"None"}),  # --dtype bfloat16 on CPU
    ],
)
def test_float32_models_ask_for_float32_dots(dtype, matmul_dtype, want):
    assert dot_precisions(dtype, matmul_dtype) == want
