"""A TPU KV cache's head axis padded per chip to rows Mosaic reads in place.

The engine's cache is ``[pages, page_size, 2 * Hkv, D]`` split over the tensor devices
on its head axis. On TPU a chip's row count other than 2, 4 or a multiple of 8 (Phi-4's
10 KV heads at TP 2: 10 rows) gets an HBM layout the attention kernel and the KV write
do not take, and XLA copied the whole cache into theirs and back in every step (four
copies a decode step, 47x the least a step must move). `layers.attention.kv_cache_shape`
pads each chip's rows on TPU (`tpu_cache_rows`: 10 to 16); the writes put zeros in the
padding and the attention reads the real heads only (``num_kv_heads``, passed by
`sharding.attention.with_real_heads`). Other platforms keep the exact rows. The
compile tests are skipped where libtpu is absent.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models.layers.attention import kv_cache_shape, tpu_cache_rows
from jaxengine.models.layers.config import LayerSpec, RopeSpec, TransformerConfig

TINY_PHI = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=512, hidden_size=256,
    intermediate_size=512, num_hidden_layers=2, num_attention_heads=20, num_key_value_heads=10,
    head_dim=128, max_position_embeddings=4096, rope_theta=10000.0, torch_dtype="bfloat16",
)  # fmt: skip
"""Phi-4's heads (10 KV heads of 128, 2 query heads each) on a tiny body."""


def test_rows_padded_per_chip_on_tpu_only():
    assert [tpu_cache_rows(r) for r in (2, 4, 6, 8, 10, 12, 16, 20, 24)] == [
        2, 4, 8, 8, 16, 16, 16, 24, 24,
    ]  # fmt: skip
    config = TransformerConfig(
        vocab_size=8, hidden_size=256, intermediate_size=8, num_heads=20, num_kv_heads=10,
        head_dim=128, layers=(LayerSpec(rope=RopeSpec()),),
    )  # fmt: skip
    assert kv_cache_shape(config, 3, 16) == (3, 16, 20, 128)
    assert kv_cache_shape(config, 3, 16, platform="gpu", shards=2) == (3, 16, 20, 128)
    assert kv_cache_shape(config, 3, 16, platform="tpu") == (3, 16, 24, 128)  # TP 1: 20 rows
    assert kv_cache_shape(config, 3, 16, platform="tpu", shards=2) == (3, 16, 32, 128)
    assert kv_cache_shape(config, 3, 16, 8, platform="tpu", shards=4) == (3, 16, 16, 128)
    small = dataclasses.replace(config, head_dim=64)  # a row of 64 values: 128 lanes on TPU
    assert kv_cache_shape(small, 3, 16, 8, platform="tpu", shards=8) == (3, 16, 16, 128)
    assert kv_cache_shape(small, 3, 16, 8, platform="gpu", shards=8) == (3, 16, 16, 64)


@pytest.mark.parametrize(
    "heads_per_chip, head_dim", [(3, 128), (5, 128), (6, 128), (10, 128), (1, 64), (4, 64)]
)
def test_padded_cache_is_written_and_read_in_place(heads_per_chip, head_dim):
    """One chip's write and attention, twice (two layers), into a donated cache padded
    to `tpu_cache_rows` rows of 128 lanes (gpt-oss's one 64-value head a chip at TP 8,
    which unpadded copied the cache twice a layer): libtpu compiles it for v6e
    without copying the cache."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jaxengine.hardware import slice_of
    from jaxengine.runner.attention_backend import select_attention_backend
    from jaxengine.tpu_check.audit import audit
    from jaxengine.tpu_check.check import tpu_devices

    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))

    def shape(dims, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    backend = select_attention_backend("auto", "tpu", device_kind="TPU v6 lite")
    attention = functools.partial(backend.attention_fn, sm_scale=0.1, num_kv_heads=heads_per_chip)
    cache = (8192, 16, tpu_cache_rows(2 * heads_per_chip), 128)  # kv_cache_shape's lanes

    def step(cache, q, k, v, slots, seq_lens, page_table, query_start_loc, num_seqs):
        for _ in range(2):
            cache = backend.update_fn(cache, k, v, slots)
            q = attention(q, cache, seq_lens, page_table, query_start_loc, num_seqs)
        return q, cache

    kv = shape((64, heads_per_chip, head_dim), jnp.bfloat16)
    q = shape((64, 2 * heads_per_chip, head_dim), jnp.bfloat16)
    args = (shape(cache, jnp.bfloat16), q, kv,
            kv, shape((64,)), shape((64,)), shape((64, 64)), shape((65,)), shape(()))  # fmt: skip
    hlo = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    assert audit(hlo, {("bf16", cache)}, set()) == []


def test_phi4_heads_at_tp_2_decode_without_copying_the_cache(tmp_path):
    """The engine at Phi-4's heads (10 KV heads, 5 a chip at TP 2 on v6e-4), 2 tiny
    layers: each chip's cache holds 16 rows, the decode step's audit is clean and
    the KV-cache sizing counts the 16 rows."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jaxengine.engine_args import EngineArgs
    from jaxengine.tpu_check.check import check_engine

    (tmp_path / "config.json").write_text(json.dumps(TINY_PHI))
    args = EngineArgs(
        model=str(tmp_path), tensor_parallel_size=2, max_model_len=1024, max_num_seqs=16,
        max_num_batched_tokens=16, compile_token_buckets=[16],
    )  # fmt: skip
    report = check_engine(args, "v6e-4", progress=False)
    assert report.fits, report.lines()
    assert [s.decode for s in report.steps] == [True]
    assert report.audit_findings == [], report.lines()
    assert report.kv_bytes_per_token == 2 * 16 * 128 * 2  # 2 layers x 16 rows x 128 x bf16
