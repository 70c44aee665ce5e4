"""The weight-only int8 / fp8 matmul (`pallas_kernels.quantized_matmul`): the Triton
kernel interpreted on CPU against the reference and exact arithmetic, its shape
errors and tiling, its CUDA lowering at Llama-3-8B's decode shapes, and the engine's
pick (`layers.quant.quantized_linear`): the kernel in a decode step lowered for CUDA,
XLA's dot for prefill, on CPU and for grouped weights."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.loader.params import abstract_params, init_inputs
from jaxengine.models.layers.quant import QuantScheme, quantize
from pallas_kernels.quantized_matmul import gpu, quantized_matmul, reference, uses_kernel
from tests.kernels.ragged_batches import TRITON_CALLS, lowered_module, lowers_for
from tests.models.test_quantization import build

WEIGHTS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}  # relative to the output's largest value


def operands(m: int, k: int, n: int, method: str, x_dtype, seed: int = 0):
    """Random ``x [m, k]``, a quantized ``w [n, k]`` and its scales ``[n]``."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    leaves = quantize(rng.standard_normal((n, k)).astype(np.float32), method, np)
    w, scale = jnp.asarray(leaves[""]), jnp.asarray(leaves["_scale"])
    assert w.dtype == WEIGHTS[method]
    return x, w, scale


def exact(x, w, scale) -> np.ndarray:
    """``x @ (w * scale).T`` in float64."""
    wf = np.asarray(w.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)[:, None]
    return np.asarray(x.astype(jnp.float32), np.float64) @ wf.T


def relative(got, want) -> float:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize(
    ("m", "k", "n", "method", "x_dtype"),
    [
        (1, 512, 128, "int8", "bfloat16"),  # 2 K-splits
        (1, 512, 128, "fp8", "float32"),
        (7, 256, 96, "fp8", "bfloat16"),  # block_n 32: N not a multiple of 64
        (7, 256, 96, "int8", "float32"),
        (32, 2048, 64, "int8", "bfloat16"),  # 8 K-splits
        (32, 2048, 64, "fp8", "float32"),
        (5, 80, 48, "int8", "bfloat16"),  # blocks of 16: K, N multiples of nothing larger
    ],
)
def test_interpreted_kernel_matches_the_reference(m, k, n, method, x_dtype):
    x, w, scale = operands(m, k, n, method, x_dtype)
    got = gpu.quantized_matmul(x, w, scale, interpret=True)
    assert got.shape == (m, n) and got.dtype == x.dtype
    want = exact(x, w, scale)
    assert relative(got, want) < TOLERANCE[x_dtype]
    assert relative(reference.quantized_matmul(x, w, scale), want) < TOLERANCE[x_dtype]
    # the kernel rounds once; the reference rounds the dot, then the product
    assert relative(got, np.asarray(reference.quantized_matmul(x, w, scale), np.float64)) < (
        2 * TOLERANCE[x_dtype]
    )


def test_forced_blocks_and_one_split_agree():
    x, w, scale = operands(3, 1024, 128, "int8", jnp.float32)
    want = exact(x, w, scale)
    for blocks in ({"splits": 1}, {"splits": 4, "block_k": 128, "block_n": 32}):
        got = gpu.quantized_matmul(x, w, scale, interpret=True, **blocks)
        assert relative(got, want) < TOLERANCE["float32"], blocks


def test_tiling_at_llama_decode_shapes():
    """Gate/up (224 column tiles) run unsplit; the down projection's 64 tiles split
    K four ways, so about two programs an SM read the weight."""
    assert gpu.choose_blocks(1, 4096, 14336) == gpu.Blocks(16, 64, 256, 1)
    assert gpu.choose_blocks(1, 14336, 4096) == gpu.Blocks(16, 64, 256, 4)
    assert gpu.choose_blocks(33, 4096, 6144).rows == 64


@pytest.mark.parametrize(
    ("shapes", "dtype", "message"),
    [
        (((1, 20), (32, 20), (32,)), jnp.int8, "K = 20 is not a multiple of 16"),
        (((1, 32), (40, 32), (40,)), jnp.int8, "N = 40 is not a multiple of 16"),
        (((65, 32), (32, 32), (32,)), jnp.int8, "65 rows of x"),
        (((1, 32), (32, 32), (32,)), jnp.uint8, "int8 or float8_e4m3fn"),
        (((1, 32), (32, 16), (32,)), jnp.int8, "do not agree"),
        (((1, 32), (32, 32), (16,)), jnp.int8, "do not agree"),
    ],
)
def test_shapes_it_cannot_take_are_named(shapes, dtype, message):
    (xs, ws, ss) = shapes
    x, w, s = jnp.zeros(xs, jnp.bfloat16), jnp.zeros(ws, dtype), jnp.ones(ss, jnp.float32)
    with pytest.raises(ValueError, match=message):
        gpu.quantized_matmul(x, w, s, interpret=True)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(("k", "n"), [(4096, 14336), (14336, 4096)])
def test_lowers_for_cuda_at_llama_decode_shapes(method, k, n):
    args = (
        jax.ShapeDtypeStruct((1, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k), WEIGHTS[method]),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    assert lowers_for(gpu.quantized_matmul, "cuda", *args)


def _has_kernel(fn, platform: str, *args) -> bool:
    return any(call in lowered_module(fn, platform, *args) for call in TRITON_CALLS)


def test_the_pick_runs_the_kernel_only_for_decode_on_cuda():
    x, w, scale = operands(1, 256, 64, "int8", jnp.bfloat16)
    assert _has_kernel(quantized_matmul, "cuda", x, w, scale)
    assert not _has_kernel(quantized_matmul, "cpu", x, w, scale)
    wide = jnp.zeros((gpu.MAX_ROWS + 1, 256), jnp.bfloat16)  # prefill: XLA's GEMM
    assert not _has_kernel(quantized_matmul, "cuda", wide, w, scale)
    odd = jnp.zeros((40, 256), jnp.int8)  # N not a multiple of 16: XLA
    assert not _has_kernel(quantized_matmul, "cuda", x, odd, jnp.ones((40,), jnp.float32))
    leading = jnp.zeros((2, 3, 256), jnp.bfloat16)  # [..., K]: 6 rows
    assert _has_kernel(quantized_matmul, "cuda", leading, w, scale)
    np.testing.assert_array_equal(
        quantized_matmul(x, w, scale), reference.quantized_matmul(x, w, scale)
    )


def test_a_weight_split_by_gspmd_keeps_xlas_dot():
    """Under plain jit a weight split over a mesh's devices keeps XLA's dot (the
    partitioner cannot split a Pallas call); under shard_map each device's shard is
    a plain array, and one device's weight is one too: the kernel."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",), axis_types=(AxisType.Auto,))
    x, w, _ = operands(1, 256, 64, "int8", jnp.bfloat16)
    split = jax.device_put(w, NamedSharding(mesh, P("tensor", None)))
    seen = []

    def probe(x, w):
        seen.append(uses_kernel(x, w))
        return x

    jax.jit(probe)(x, split)
    local = jax.shard_map(probe, mesh=mesh, in_specs=(P(), P("tensor", None)), out_specs=P())
    jax.jit(local)(x, split)
    jax.jit(probe)(x, w)
    assert seen == [False, True, True]


def _forward(scheme: str | QuantScheme, tokens: int, platform: str) -> bool:
    """Whether a tiny bfloat16 Llama quantized by ``scheme``, its forward over
    ``tokens`` tokens of one request lowered for ``platform``, holds a Triton kernel."""
    module, config = build("llama3_rope", scheme)
    config = dataclasses.replace(config, dtype=jnp.bfloat16)
    module = module.clone(config=config)
    params = nn.unbox(abstract_params(module, config))
    _, _, caches, md = init_inputs(config)
    ids = jnp.zeros((tokens,), jnp.int32)  # token ids and positions
    md = dataclasses.replace(
        md,
        slot_mapping=ids,
        query_start_loc=jnp.array([0, tokens], jnp.int32),
        seq_lens=jnp.array([tokens], jnp.int32),
    )

    def forward(params, ids, caches, md):
        return module.apply({"params": params}, ids, ids, caches, md, method="forward_and_logits")

    return _has_kernel(forward, platform, params, ids, caches, md)


def test_an_int8_model_decodes_through_the_kernel_on_cuda():
    assert _forward("int8", 1, "cuda")
    assert not _forward("int8", 1, "cpu")
    assert not _forward("int8", 2 * gpu.MAX_ROWS, "cuda")  # prefill: XLA's GEMMs
    assert not _forward(QuantScheme("int8", 32), 1, "cuda")  # grouped: dequantized
