"""The MXFP4 grouped matmul (gpt-oss's experts): the Mosaic kernel under TPU interpret
mode against its reference (the experts dequantized whole, then `ragged_dot`), on
sorted rows with empty experts, row tiles shared by two experts and rows of no expert;
the decodings against the spec; and the kernel compiled for v6e at gpt-oss-120b's
expert shapes, whose step then moves only the 4-bit experts (no widened copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4_gmm import reference, tpu

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def test_decodings_follow_the_spec():
    """Every e2m1 code is its table value; every e8m0 byte's two factors multiply to
    ``2^(s - 127)`` and are each a normal float32 (255: infinity)."""
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(reference.e2m1(codes)), np.array(E2M1, np.float32))
    np.testing.assert_array_equal(reference.e2m1(np.arange(16), np), np.array(E2M1, np.float32))
    s = np.arange(256)
    low, high = (np.asarray(f, np.float64) for f in reference.e8m0(jnp.asarray(s)))
    assert (low >= np.finfo(np.float32).tiny).all() and (high >= np.finfo(np.float32).tiny).all()
    np.testing.assert_array_equal(low * high, np.ldexp(1.0, s - 127))
    np.testing.assert_array_equal(np.stack(reference.e8m0(s, np)), np.stack([low, high]))


def _case(seed: int, sizes: list[int], num_rows: int, k: int = 256, n: int = 256):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    packed = jnp.asarray(rng.integers(0, 256, (g, k // 2, n)), jnp.uint8)
    scales = jnp.asarray(rng.integers(118, 136, (g, k // 32, n)), jnp.uint8)
    x = jnp.asarray(rng.standard_normal((num_rows, k)), jnp.bfloat16)
    return x, packed, scales, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize(
    "sizes, num_rows, block_rows",
    [
        ([9, 0, 20, 5], 40, 16),  # tiles shared by two experts, an empty one, 6 rows of none
        ([1, 1, 0, 1], 4, None),  # a decode step's routes: one row each
        ([0, 0, 0, 0], 8, None),  # no row for these experts (all routed elsewhere)
        ([70, 3, 0, 60], 133, 32),  # prefill-sized groups over several tiles each
    ],
)
def test_matches_reference(sizes, num_rows, block_rows):
    """Rows of every expert equal the reference (exactly: the dequantized weights
    are exact in bfloat16 and the sums are float32 either way)."""
    x, packed, scales, group_sizes = _case(len(sizes) + num_rows, sizes, num_rows)
    want = reference.mxfp4_ragged_dot(x, packed, scales, group_sizes)
    got = tpu.mxfp4_ragged_dot(
        x, packed, scales, group_sizes, block_rows=block_rows, interpret=True
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    mine = sum(sizes)
    np.testing.assert_allclose(
        np.asarray(got[:mine], np.float32),
        np.asarray(want[:mine], np.float32),
        rtol=1e-2,
        atol=1e-2,
    )


def test_tiles_cover_each_expert_row_once():
    """The step list: each (expert, row tile) pair holding rows of that expert, in
    order, then repeats of the last live pair; the first step of each row tile and of
    each expert flagged."""
    group, row, live, new_row, new_group = (
        np.asarray(a) for a in tpu.tiles(jnp.asarray([9, 0, 20, 5], jnp.int32), 48, 16)
    )
    assert len(group) == 48 // 16 + 4
    assert live.tolist() == [1, 1, 1, 1, 1, 0, 0]  # rows 0-8, 9-28, 29-33 in tiles of 16
    pairs = list(zip(group[:5].tolist(), row[:5].tolist(), strict=True))
    assert pairs == [(0, 0), (2, 0), (2, 1), (3, 1), (3, 2)]
    assert (group[5:] == 3).all() and (row[5:] == 2).all()
    assert new_row[:5].tolist() == [1, 0, 1, 0, 1] and new_group[:5].tolist() == [1, 1, 0, 1, 0]


def test_compiles_for_v6e_reading_only_the_packed_experts():
    """gpt-oss-120b's experts on one v6e chip at TP 8 with expert parallelism (16
    experts of 2880 x 2880): the kernel compiles for decode and prefill row counts, and
    the step's temporaries stay under 1 MB (the reference widens all 16 experts to
    bfloat16 in HBM: 265 MB a projection)."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxengine.hardware import slice_of
    from jaxengine.tpu_check.check import tpu_devices

    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))

    def shape(dims, dtype):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    g, k, n = 16, 2880, 2880
    for rows in (4, 1024):
        args = (shape((rows, k), jnp.bfloat16), shape((g, k // 2, n), jnp.uint8),
                shape((g, k // 32, n), jnp.uint8), shape((g,), jnp.int32))  # fmt: skip
        compiled = jax.jit(tpu.mxfp4_ragged_dot).lower(*args).compile()
        assert "tpu_custom_call" in compiled.as_text()
        assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20
