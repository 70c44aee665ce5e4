"""The quantized grouped matmuls (gpt-oss's MXFP4 experts, DeepSeek-V3's block-fp8
ones): the Mosaic kernel under TPU interpret mode against its reference (the experts
dequantized whole, then `ragged_dot`), on sorted rows with empty experts, row tiles
shared by two experts and rows of no expert, over one or several column tiles; the
decodings against the spec (fp8: `layers.quant.dequantize`); and the kernel compiled
for v6e at gpt-oss-120b's and DeepSeek-V3's expert shapes, whose step then moves only
the stored experts (no widened copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_gmm import reference, tpu

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
    "sizes, num_rows, block_rows, block_cols",
    [
        ([9, 0, 20, 5], 40, 16, 512),  # tiles shared by two experts, an empty one, 6 rows of none
        ([1, 1, 0, 1], 4, None, 512),  # a decode step's routes: one row each
        ([0, 0, 0, 0], 8, None, 512),  # no row for these experts (all routed elsewhere)
        ([70, 3, 0, 60], 133, 32, 512),  # prefill-sized groups over several tiles each
        ([9, 0, 20, 5], 40, 16, 128),  # two column tiles
    ],
)
def test_matches_reference(sizes, num_rows, block_rows, block_cols):
    """Rows of every expert equal the reference (exactly: the dequantized weights
    are exact in bfloat16 and the sums are float32 either way)."""
    x, packed, scales, group_sizes = _case(len(sizes) + num_rows, sizes, num_rows)
    want = reference.mxfp4_ragged_dot(x, packed, scales, group_sizes)
    got = tpu.mxfp4_ragged_dot(
        x, packed, scales, group_sizes, block_rows=block_rows, block_cols=block_cols,
        interpret=True,
    )  # fmt: skip
    _assert_expert_rows_match(got, want, sum(sizes))


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
    mesh = _one_chip()
    g, k, n = 16, 2880, 2880
    for rows in (4, 1024):
        args = _abstract(mesh, ((rows, k), jnp.bfloat16), ((g, k // 2, n), jnp.uint8),
                         ((g, k // 32, n), jnp.uint8), ((g,), jnp.int32))  # fmt: skip
        compiled = jax.jit(tpu.mxfp4_ragged_dot).lower(*args).compile()
        assert "tpu_custom_call" in compiled.as_text()
        assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20


def _fp8_case(seed: int, sizes: list[int], num_rows: int, k: int, n: int, group: int):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    wide = np.clip(rng.standard_normal((g, k, n)) * 100, -448, 448)  # e4m3's range, no NaN
    values = jnp.asarray(wide, jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(1e-4, 1e-2, (g, k // group, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((num_rows, k)), jnp.bfloat16)
    return x, values, scales, jnp.asarray(sizes, jnp.int32)


def test_fp8_decoding_is_the_quantized_layers():
    """`reference.dequantize_fp8` is `layers.quant.dequantize` of the transposed
    grouped ``fp8`` leaves, bit for bit."""
    from jaxengine.models.layers import quant

    _, values, scales, _ = _fp8_case(0, [1, 1], 1, 256, 128, 64)
    leaves = {"": values, "_scale": scales}
    want = quant.dequantize(leaves, quant.QuantScheme("fp8", 64), transpose=True)
    np.testing.assert_array_equal(np.asarray(reference.dequantize_fp8(values, scales)), want)


@pytest.mark.parametrize(
    "sizes, num_rows, block_rows, n, block_cols, group",
    [
        ([9, 0, 20, 5], 40, 16, 256, 128, 128),  # shared tiles, an empty expert, two column tiles
        ([1, 1, 0, 1], 4, None, 384, 512, 64),  # a decode step, one column tile of 384
        ([0, 0, 0, 0], 8, None, 256, 128, 128),  # no row for these experts
        ([70, 3, 0, 60], 133, 32, 256, 256, 32),  # several row tiles each, groups of 32
    ],
)
def test_fp8_matches_reference(sizes, num_rows, block_rows, n, block_cols, group):
    """Block-fp8 experts: rows of every expert equal the reference up to the order of
    the float32 sums (the same bfloat16 weights)."""
    x, values, scales, group_sizes = _fp8_case(num_rows, sizes, num_rows, 512, n, group)
    want = reference.fp8_ragged_dot(x, values, scales, group_sizes)
    got = tpu.fp8_ragged_dot(
        x, values, scales, group_sizes, block_rows=block_rows, block_cols=block_cols,
        interpret=True,
    )  # fmt: skip
    _assert_expert_rows_match(got, want, sum(sizes))


def _assert_expert_rows_match(got, want, mine: int) -> None:
    """The kernel's output has the reference's shape and dtype, and its first ``mine``
    rows (those of some expert) the reference's values (bfloat16 outputs)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got[:mine], np.float32), np.asarray(want[:mine], np.float32), rtol=1e-2,
        atol=1e-2,
    )  # fmt: skip


def test_column_tiles():
    """The largest multiple of 128 dividing the output width, at most the bound; the
    whole width when none divides it (gpt-oss's 2880)."""
    assert tpu.block_cols_for(7168, 512) == 512 and tpu.block_cols_for(2048, 1024) == 1024
    assert tpu.block_cols_for(384, 512) == 384 and tpu.block_cols_for(640, 512) == 128
    assert tpu.block_cols_for(2880, 512) == 2880 and tpu.block_cols_for(96, 512) == 96


@pytest.mark.parametrize("tpu_slice", ["v6e-1", "v5p-8"])
def test_fp8_compiles_reading_only_the_stored_experts(tpu_slice):
    """DeepSeek-V3's experts on one chip at TP 16 with expert parallelism (16 experts,
    gate/up 7168 -> 2048, down 2048 -> 7168, fp8 in groups of 128), on v6e and v5p: the
    kernel compiles for decode and prefill row counts, and the step's temporaries stay
    under 4 MB (0.2-0.7 MB; the reference widens all 16 experts to bfloat16 in HBM:
    470 MB a projection; a whole expert, 29 MB of bfloat16, fits VMEM only cut into
    column tiles)."""
    mesh = _one_chip(tpu_slice)
    g = 16
    for k, n in ((7168, 2048), (2048, 7168)):
        for rows in (8, 1024):
            args = _abstract(mesh, ((rows, k), jnp.bfloat16), ((g, k, n), jnp.float8_e4m3fn),
                             ((g, k // 128, n), jnp.float32), ((g,), jnp.int32))  # fmt: skip
            compiled = jax.jit(tpu.fp8_ragged_dot).lower(*args).compile()
            assert "tpu_custom_call" in compiled.as_text()
            assert compiled.memory_analysis().temp_size_in_bytes < 4 << 20


def _one_chip(tpu: str = "v6e-1"):
    """A mesh of one chip of the slice ``tpu``, as libtpu describes it (no TPU needed)."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh

    from jaxengine.hardware import slice_of
    from jaxengine.tpu_check.check import tpu_devices

    return Mesh(tpu_devices(slice_of(tpu))[:1], ("x",))


def _abstract(mesh, *specs):
    """Replicated abstract arguments of these (shape, dtype)."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec())
    return tuple(jax.ShapeDtypeStruct(dims, dtype, sharding=sharding) for dims, dtype in specs)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["one", "ep2"])
def test_fp8_experts_pass_as_stored_through_the_moe(expert_parallel):
    """Block-fp8 experts in groups dividing their input reach `routed_experts` as
    `Fp8Experts` (`layers.mlp.as_stored`) and give what their dequantized stacks give,
    on one device and split by expert over two (the CPU path: the reference); a
    partial last group keeps the dequantized stack."""
    from jax.sharding import Mesh

    from jaxengine.models.layers import mlp, quant
    from sharding.experts import expert_parallel_fn

    scheme, rng = quant.QuantScheme("fp8", 32), np.random.default_rng(0)
    e, hidden, width, tokens = 4, 64, 96, 6

    def experts(out, inp):  # [E, in, out] leaves, as `SparseMoE` holds them
        leaves = quant.quantize(rng.standard_normal((e, out, inp)), scheme, np)
        return {s: jnp.asarray(v) for s, v in quant.transposed(leaves).items()}

    stacks = [experts(width, hidden), experts(width, hidden), experts(hidden, width)]
    stored = [mlp.as_stored(leaves, scheme, leaves[""].shape[1]) for leaves in stacks]
    assert all(isinstance(w, mlp.Fp8Experts) for w in stored)
    assert stored[2].shape == (e, width, hidden)
    assert mlp.as_stored(stacks[0], scheme, 40) is None  # 40 inputs: a partial group
    dense = [quant.dequantize(leaves, scheme, transpose=True) for leaves in stacks]
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 2)), jnp.float32)
    routes = jnp.asarray(rng.integers(0, e, (tokens, 2)), jnp.int32)
    fn = mlp.routed_experts
    if expert_parallel:
        fn = expert_parallel_fn(Mesh(np.array(jax.devices()[:2]), ("tensor",)))
    got, want = (fn(x, weights, routes, *w, act=jax.nn.silu) for w in (stored, dense))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
