"""DeepSeek-V3's latent KV cache: its size per token, from the model's real dimensions
up to what a running engine allocates. Numerics: `test_golden_tiny.py` (logits) and
`test_new_families_engine.py` (the engine, TP 1 / TP 2 / EP 2)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
import transformers

from jaxengine.models import family_config
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.attention_backend import select_attention_backend
from jaxengine.runner.kv_sizing import bytes_per_block
from tests.models.deepseek_v3_tiny import MLA_SIZES, deepseek_v3_tiny
from tests.models.family_engine import ENGINE_KWARGS, save_tiny
from tests.models.tiny_configs import TINY_SIZES


def test_real_v3_caches_576_values_a_token_and_layer():
    """DeepSeek-V3's own dimensions (kv_lora_rank 512 + rope 64, 61 layers, 128 heads,
    bfloat16): one cache row of 576 values a token, no head axis, where the expanded
    keys and values would take 128 x (192 + 128); on TPU the row is padded to 640 lanes
    (5 x 128), which its kernels and cache write read and write in place."""
    hf = transformers.DeepseekV3Config()  # the published model's sizes
    assert (hf.kv_lora_rank, hf.qk_rope_head_dim, hf.num_hidden_layers) == (512, 64, 61)
    config = family_config(hf, jnp.bfloat16)
    block = 16
    assert kv_cache_shape(config, 10, block) == (10, block, 1, 576)
    kv_parts = kv_cache_shape(config, 1, 1, 1)[2]  # a device's rows (worker.build._rows_per_device)
    per_block = bytes_per_block(61, block, 1, config.head_dim, 2, kv_parts=kv_parts)
    assert per_block / block == 576 * 2 * 61
    assert kv_cache_shape(config, 10, block, platform="tpu") == (10, block, 1, 640)
    assert kv_cache_shape(config, 10, block, platform="gpu") == (10, block, 1, 576)


@pytest.mark.parametrize("parallel", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_engine_allocates_and_sizes_the_latent_cache(parallel, tmp_path):
    """A running engine's caches: one ``[pages, 8, 1, 40]`` row array per layer and
    device (tp 2: ``[pages, 8, 2, 40]`` split on axis 2), and its start-up sizing counts
    exactly those bytes, 40 float32 values a token and layer."""
    from jaxengine import LLM

    small = dict(TINY_SIZES, vocab_size=256)
    path = save_tiny(transformers.DeepseekV3Config(**deepseek_v3_tiny(small)), tmp_path)
    row = MLA_SIZES["kv_lora_rank"] + MLA_SIZES["qk_rope_head_dim"]
    tp = parallel.get("tensor_parallel_size", 1)
    llm = LLM(str(path), **{**ENGINE_KWARGS, "num_gpu_blocks_override": 16, **parallel})
    try:
        caches = llm.engine.executor.runner.kv_caches
        assert len(caches) == 4
        assert {c.shape for c in caches} == {(16, 8, tp, row)}
        assert {s.data.shape for s in caches[0].addressable_shards} == {(16, 8, 1, row)}
        per_block = llm.engine.kv_cache_size.bytes_per_block
        assert per_block == 4 * 8 * row * 4  # layers x page x row x float32, per device
        shard_page = caches[0].addressable_shards[0].data.shape[1:]  # one page, one device
        assert per_block == len(caches) * math.prod(shard_page) * caches[0].dtype.itemsize
    finally:
        llm.engine.shutdown()


MLA_TABLE = {  # (requested, platform) -> backend name, `pallas_kernels.mla` module
    ("auto", "cpu"): ("mla-reference", "reference"),
    ("auto", "gpu"): ("mla-pallas-gpu", "gpu"),
    ("auto", "tpu"): ("mla-pallas-tpu", "tpu"),
    ("pallas", "cpu"): ("mla-pallas-gpu-interpret", "gpu"),
    ("pallas", "gpu"): ("mla-pallas-gpu", "gpu"),
    ("pallas", "tpu"): ("mla-pallas-tpu", "tpu"),
    ("reference", "cpu"): ("mla-reference", "reference"),
    ("reference", "gpu"): ("mla-reference", "reference"),
    ("reference", "tpu"): ("mla-reference", "reference"),
}


@pytest.mark.parametrize("requested, platform", sorted(MLA_TABLE))
def test_an_mla_model_gets_the_mla_functions(requested, platform):
    """The latent cache is read and written only by `pallas_kernels.mla` (the GQA
    kernels would misread its rows): the platform's kernels as for GQA, the reference
    where asked and for ``auto`` on CPU; a bad flag still fails."""
    import importlib

    name, module = MLA_TABLE[requested, platform]
    mla = importlib.import_module(f"pallas_kernels.mla.{module}")
    backend = select_attention_backend(requested, platform, mla=True)
    assert backend.name == name
    functions = [getattr(f, "func", f) for f in (backend.attention_fn, backend.update_fn)]
    assert functions == [mla.ragged_paged_mla, mla.update_mla_cache]
    with pytest.raises(ValueError, match="attention-backend"):
        select_attention_backend("flash", platform, mla=True)


def test_the_tpu_mla_kernel_is_sized_for_its_generation():
    from jaxengine.hardware import chip_named

    backend = select_attention_backend("auto", "tpu", device_kind="TPU v6 lite", mla=True)
    assert backend.attention_fn.keywords["vmem_limit_bytes"] == chip_named("v6e").vmem_limit_bytes


def test_unsupported_options_are_refused_not_ignored():
    """An fp8 KV cache with k/v scales (or LoRA) would be silently skipped by the
    latent attention: building the model says so instead."""
    import dataclasses

    from jaxengine.loader.params import abstract_params
    from jaxengine.models.deepseek_v3 import DeepseekV3ForCausalLM

    hf = transformers.DeepseekV3Config(**deepseek_v3_tiny(dict(TINY_SIZES, vocab_size=64)))
    config = family_config(hf, jnp.float32)
    abstract_params(DeepseekV3ForCausalLM(config), config)  # as published: builds
    scaled = dataclasses.replace(config, kv_cache_scales=True)
    with pytest.raises(NotImplementedError, match="k/v scales"):
        abstract_params(DeepseekV3ForCausalLM(scaled), scaled)
