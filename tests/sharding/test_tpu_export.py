"""The engine's step lowers for TPU: a Llama-3-8B-shaped model under TP 4 and TP 8.

No TPU is at hand, so the check is the one a TPU user's first start would fail at
before running anything: `jax.export` lowers the engine's real step function (the
`SingleStage` program, `runner.step.make_step`, with the `pallas-tpu` backend's
kernels) for the ``tpu`` platform, from abstract parameters placed by the engine's own
`Placement` on a 4- and 8-device mesh (virtual CPU devices stand in for the chips:
lowering needs only the mesh's shape). Both a decode bucket (64 requests, one token
each) and a prefill bucket (512 tokens over 4 requests) are lowered.

The model has Llama-3-8B's dimensions (32 query heads, 8 KV heads, head 128, hidden
4096, MLP 14336, vocabulary 128256) and 2 of its 32 layers: every layer lowers the same
way, and 2 keep the test to seconds.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.parallel_memory import llama3_8b
from jaxengine.config.parallel import ParallelConfig
from jaxengine.loader.params import abstract_params, logical_axes
from jaxengine.models import get_model
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.attention_backend import select_attention_backend
from jaxengine.runner.batch import pack_batch
from jaxengine.runner.program import single_stage
from jaxengine.runner.step import step_inputs
from sharding.placement import Placement

PAGE_SIZE = 16
MAX_MODEL_LEN = 8192
NUM_PAGES = 1024
BUCKETS = {"decode": (64, 64), "prefill": (512, 4)}  # tokens, requests


@pytest.fixture(scope="module")
def model():
    module, config = get_model(llama3_8b(layers=2), jnp.bfloat16)
    boxed = abstract_params(module, config)
    return module, config, boxed


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def _exported_step(model, tp: int, bucket: str):
    module, config, boxed = model
    abstract = nn.unbox(boxed)
    placement = Placement(ParallelConfig(tensor_parallel_size=tp), jax.devices()[:tp])
    params = _abstract(abstract, placement(config, logical_axes(boxed), abstract))
    plan = placement.plans[0]
    backend = select_attention_backend("auto", "tpu")
    assert backend.name == "pallas-tpu"
    stage = single_stage(module, len(config.layers), plan, backend.module_kwargs(), k=20)
    shape = kv_cache_shape(config, NUM_PAGES, PAGE_SIZE, plan.kv_cache_heads)
    cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=plan.kv_cache_sharding)
    caches = (cache,) * len(config.layers)
    tokens, reqs = BUCKETS[bucket]
    batch = pack_batch(
        [], page_size=PAGE_SIZE, num_tokens=tokens, num_reqs=reqs,
        pages_per_req=MAX_MODEL_LEN // PAGE_SIZE,
    )  # fmt: skip
    buffers, spec = step_inputs(batch)
    buffers = jax.tree_util.tree_map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype), buffers)
    fed_ids = jax.ShapeDtypeStruct((reqs,), np.int32)
    export = jax.export.export(stage._step, platforms=["tpu"])
    return export(params, caches, buffers, fed_ids, spec=spec)


@pytest.mark.parametrize("bucket", sorted(BUCKETS))
@pytest.mark.parametrize("tp", [4, 8])
def test_llama3_8b_step_lowers_for_tpu(model, tp, bucket):
    exported = _exported_step(model, tp, bucket)
    assert exported.platforms == ("tpu",)
    assert exported.nr_devices == tp
    text = exported.mlir_module()
    assert f'"tensor"={tp}]' in text and f"mhlo.num_partitions = {tp}" in text
    # the Pallas TPU kernels (attention, the KV-cache write) are Mosaic custom calls,
    # called once per layer on each device's shard: its queries ([T, 32 / tp, 128])
    # and its pages' KV heads (2 x 8 / tp). The two layers share one lowered body
    # (`layers.decoder.run_layers`), called once per layer, that calls each kernel once.
    assert "stablehlo.custom_call @tpu_custom_call" in text
    assert len(re.findall(r"call @decoder_layer\(", text)) == 2
    for kernel in ("ragged_paged_attention", "update_kv_cache"):
        assert len(re.findall(rf"call @{kernel}\(", text)) == 1, kernel
    tokens, reqs = BUCKETS[bucket]
    arg = r"(tensor<[^>]*>)"
    signature = rf"func.func private @ragged_paged_attention\(%arg0: {arg}.*?%arg1: {arg}"
    q, cache = re.search(signature, text).groups()
    assert q == f"tensor<{tokens}x{32 // tp}x128xbf16>"
    assert cache == f"tensor<{NUM_PAGES}x{PAGE_SIZE}x{16 // tp}x128xbf16>"
    # the logits come back whole over the tensor group ([R, V])
    assert exported.out_avals[0].shape == (reqs, 128256)
