"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the reference against transformers' torch
functions, its chunked form against its recurrent form on ragged batches (prompts
split across steps inside a chunk), and the Pallas kernels against the reference:
in interpret mode on CPU, compiled by libtpu for v5e and v6e, lowered for CUDA.
The kernels take the state pool and each request's row (`reference.gated_delta_rule`);
most tests here run them on gathered states (`on_states`: the states are the pool);
`test_gated_delta_pool.py` runs them on a pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.gated_delta import chunk, gpu, reference, tpu
from tests.kernels.ragged_batches import jitted, lowers_for, relative_error

POOL_KERNELS = {"tpu": tpu.gated_delta_rule, "gpu": gpu.gated_delta_rule}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
ARG_NAMES = ("q", "k", "v", "g", "beta", "query_start_loc", "num_seqs", "initial_state")


def ragged_batch(lens, pad_reqs=1, pad_tokens=3, hk=2, hv=4, dk=16, dv=16, seed=0) -> dict:
    """A step's arguments (numpy, float32): requests with ``lens`` new tokens, then
    ``pad_reqs`` padding requests and ``pad_tokens`` padding tokens. ``g`` and ``beta``
    as Qwen3-Next makes them (``-exp(A_log) * softplus(a + dt_bias)``, ``sigmoid(b)``)."""
    rng = np.random.default_rng(seed)
    num_tokens, num_reqs = sum(lens) + pad_tokens, len(lens) + pad_reqs
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1 : len(lens) + 1] = np.cumsum(lens)
    qsl[len(lens) + 1 :] = qsl[len(lens)]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a_log = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
    return dict(
        q=normal(num_tokens, hk, dk),
        k=normal(num_tokens, hk, dk),
        v=normal(num_tokens, hv, dv),
        g=(-np.exp(a_log) * np.logaddexp(0, normal(num_tokens, hv) - 4)).astype(np.float32),
        beta=(1 / (1 + np.exp(-normal(num_tokens, hv)))).astype(np.float32),
        query_start_loc=qsl,
        num_seqs=np.int32(len(lens)),
        initial_state=0.3 * normal(num_reqs, hv, dk, dv),
    )


def on_states(kernel):
    """A kernel of the pool form on gathered states (the rule's other functions'
    form): the states ``[R, ...]`` are the pool, request ``r`` its row ``r``; the
    padding requests (past ``num_seqs``) write nothing, so their states come back
    unchanged."""

    def run(*args, **options):
        *head, initial_state = args
        rows = jnp.arange(initial_state.shape[0], dtype=jnp.int32)
        return kernel(*head, initial_state, rows, jnp.zeros(rows.shape, bool), **options)

    return run


KERNELS = {name: on_states(kernel) for name, kernel in POOL_KERNELS.items()}


def args_of(batch: dict, dtype=jnp.float32) -> tuple:
    token_data = ("q", "k", "v")
    return tuple(
        jnp.asarray(batch[n], dtype if n in token_data else None) for n in ARG_NAMES
    )  # fmt: skip


def assert_close(got, want, tol=1e-5):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "NaN or inf"
    err = relative_error(got, want)
    assert err < tol, f"relative error {err:.2e}"


# ---- the reference against transformers (float32) ----


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next

    return torch, modeling_qwen3_next


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw-qk"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_reference_matches_transformers(hf, form, l2norm):
    """Each request of a ragged batch against transformers' function on that request
    alone, with its initial state: GQA (2 key heads, 4 value heads), lengths across
    chunk boundaries (chunks of 16 here; transformers' chunk function uses 64)."""
    torch, modeling = hf
    batch = ragged_batch([5, 1, 70, 33, 16], dk=32, dv=16, seed=1)
    if not l2norm:  # raw keys must keep the rule stable: |k|^2 beta < 2
        batch["q"], batch["k"] = 0.15 * batch["q"], 0.15 * batch["k"]
    options = dict(use_qk_l2norm=l2norm)
    if form == "chunked":
        fn = jitted(reference.chunked_gated_delta_rule, chunk_size=16, **options)
    else:
        fn = jitted(reference.recurrent_gated_delta_rule, **options)
    out, state = fn(*args_of(batch))
    qsl = batch["query_start_loc"]
    torch_fn = {
        "recurrent": modeling.torch_recurrent_gated_delta_rule,
        "chunked": modeling.torch_chunk_gated_delta_rule,
    }[form]
    for r in range(int(batch["num_seqs"])):
        rows = slice(qsl[r], qsl[r + 1])
        t = lambda name: torch.from_numpy(batch[name][rows][None])  # noqa: E731, B023
        want_out, want_state = torch_fn(
            t("q"), t("k"), t("v"), g=t("g"), beta=t("beta"),
            initial_state=torch.from_numpy(batch["initial_state"][r : r + 1]),
            output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        assert_close(np.asarray(out)[rows], want_out[0].numpy())
        assert_close(np.asarray(state)[r], want_state[0].numpy())
    real = qsl[int(batch["num_seqs"])]
    np.testing.assert_array_equal(np.asarray(out)[real:], 0.0)
    np.testing.assert_array_equal(np.asarray(state)[-1], batch["initial_state"][-1])


def conv_batch(lens, channels=24, taps=4, seed=0):
    rng = np.random.default_rng(seed)
    num_reqs, num_tokens = len(lens) + 1, sum(lens) + 2
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1:num_reqs] = np.cumsum(lens)
    qsl[num_reqs] = qsl[num_reqs - 1]
    return dict(
        x=rng.standard_normal((num_tokens, channels)).astype(np.float32),
        weight=rng.standard_normal((channels, taps)).astype(np.float32),
        bias=rng.standard_normal(channels).astype(np.float32),
        conv_state=rng.standard_normal((num_reqs, taps - 1, channels)).astype(np.float32),
        query_start_loc=qsl,
        num_seqs=np.int32(len(lens)),
    )


def run_conv(batch, activation="silu", bias=True):
    names = ("x", "weight", "bias", "conv_state", "query_start_loc", "num_seqs")
    args = [jnp.asarray(batch[n]) for n in names]
    if not bias:
        args[2] = None
    return jax.jit(functools.partial(reference.causal_conv1d, activation=activation))(*args)


@pytest.mark.parametrize("activation, bias", [("silu", False), (None, True)])
def test_conv_matches_transformers(hf, activation, bias):
    """Against ``causal_conv1d_update`` (a cached request: its window is the state,
    which transformers keeps ``K`` wide) and ``causal_conv1d_fn`` (a new one: zeros),
    for requests of 1, 2 (fewer than ``K - 1``), 3 and 11 new tokens."""
    torch, modeling = hf
    batch = conv_batch([1, 2, 3, 11])
    batch["conv_state"][2] = 0.0  # request 2 is new: transformers' prefill path
    y, new_state = run_conv(batch, activation, bias)
    qsl, weight = batch["query_start_loc"], torch.from_numpy(batch["weight"])
    b = torch.from_numpy(batch["bias"]) if bias else None
    for r in range(int(batch["num_seqs"])):
        x = torch.from_numpy(batch["x"][qsl[r] : qsl[r + 1]].T.copy())[None]  # [1, C, n]
        if r == 2:
            want = modeling.causal_conv1d_fn(x, weight, b, activation=activation)
            window = torch.cat([torch.zeros(1, x.shape[1], 3), x], dim=-1)[..., -3:]
        else:
            state = torch.from_numpy(batch["conv_state"][r].T.copy())[None]  # [1, C, K-1]
            window = torch.cat([torch.zeros(1, x.shape[1], 1), state], dim=-1)  # K wide
            want = modeling.causal_conv1d_update(x, window, weight, b, activation)
            window = window[..., 1:]
        assert_close(np.asarray(y)[qsl[r] : qsl[r + 1]], want[0].numpy().T)
        assert_close(np.asarray(new_state)[r], window[0].numpy().T)
    np.testing.assert_array_equal(np.asarray(y)[qsl[-1] :], 0.0)
    np.testing.assert_array_equal(np.asarray(new_state)[-1], batch["conv_state"][-1])


def test_conv_split_across_steps_matches_one_step():
    """A prompt of 9 tokens in one step, and in steps of 2, 1 and 6 with the conv
    state carried: the same outputs and final state."""
    whole = conv_batch([9], seed=3)
    y, state = run_conv(whole)
    pieces, carried, start = [], whole["conv_state"][:1], 0
    for n in (2, 1, 6):
        step = dict(whole, x=whole["x"][start : start + n], conv_state=carried)
        step["query_start_loc"] = np.array([0, n], np.int32)
        y_step, carried = run_conv(step)
        pieces.append(np.asarray(y_step))
        start += n
    assert_close(np.concatenate(pieces), np.asarray(y)[:9])
    assert_close(np.asarray(carried)[0], np.asarray(state)[0])


# ---- the chunked form against the recurrent form ----


def test_kernel_chunk_step_matches_reference_chunk_step():
    """`chunk.chunk_step` (block-doubling inverse, column scalars) against
    `reference.chunk_step` (triangular solve), keys nearly parallel (the solve's
    hard case) and a partial chunk."""
    rng = np.random.default_rng(5)
    size, dk, dv = 64, 32, 16
    k = rng.standard_normal((size, dk)) * 0.05 + rng.standard_normal((1, dk))
    x = [k, rng.standard_normal((size, dk)), rng.standard_normal((size, dv))]
    g, beta = -rng.uniform(0, 0.3, size), rng.uniform(0.5, 1.0, size)
    for arr in (*x, g, beta):
        arr[50:] = 0.0
    k, q = (reference.l2norm(jnp.asarray(a, jnp.float32)) for a in x[:2])
    v, g, beta = (jnp.asarray(a, jnp.float32) for a in (x[2], g, beta))
    state = jnp.asarray(rng.standard_normal((dk, dv)), jnp.float32)
    want = reference.chunk_step(q, k, v, g, beta, state)
    got = chunk.chunk_step(q, k, v, g[:, None], beta[:, None], state)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def chunked_vs_recurrent(batch, chunk_size, **options):
    want = jitted(reference.recurrent_gated_delta_rule, **options)(*args_of(batch))
    got = jitted(reference.chunked_gated_delta_rule, chunk_size=chunk_size, **options)(
        *args_of(batch)
    )
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@settings(max_examples=3, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    chunk_size=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_matches_recurrent_on_ragged_batches(lens, chunk_size, seed):
    chunked_vs_recurrent(ragged_batch(lens, seed=seed), chunk_size)


def test_chunked_matches_recurrent_with_its_options():
    """Equal key and value heads, no L2 norm, a scale of one's own, no padding."""
    batch = ragged_batch([13, 1, 29], pad_reqs=0, pad_tokens=0, hk=4, hv=4, seed=2)
    batch["q"], batch["k"] = 0.15 * batch["q"], 0.15 * batch["k"]
    chunked_vs_recurrent(batch, 8, use_qk_l2norm=False, scale=0.7)


def split(batch: dict, request: int, first: int) -> tuple[dict, dict]:
    """``batch`` as two steps: ``request``'s first ``first`` tokens in the first step
    (alone), the rest in the second (with the other requests); the second step's
    state for ``request`` is filled in by the caller."""
    qsl = batch["query_start_loc"]
    a, b = int(qsl[request]), int(qsl[request + 1])
    head = {n: batch[n][a : a + first] for n in ("q", "k", "v", "g", "beta")}
    head.update(
        query_start_loc=np.array([0, first], np.int32),
        num_seqs=np.int32(1),
        initial_state=batch["initial_state"][request : request + 1],
    )
    keep = np.r_[0:a, a + first : len(batch["g"])]
    tail = {n: batch[n][keep] for n in ("q", "k", "v", "g", "beta")}
    lengths = np.diff(qsl)
    lengths[request] = b - a - first
    tail.update(
        query_start_loc=np.r_[0, np.cumsum(lengths)].astype(np.int32),
        num_seqs=batch["num_seqs"],
        initial_state=batch["initial_state"].copy(),
    )
    return head, tail


@pytest.mark.parametrize("fn", ["chunked", "tpu", "gpu"])
def test_prompt_split_inside_a_chunk_matches_one_step(fn):
    """Chunked prefill splitting a prompt at token 37 (inside a chunk of 16): the
    second step starts its chunks at its own first token, with the state carried, and
    both steps together give the one-step outputs and final state."""
    run = {
        "chunked": jitted(reference.chunked_gated_delta_rule, chunk_size=16),
        "tpu": jitted(KERNELS["tpu"], chunk_size=16, interpret=True),
        "gpu": jitted(KERNELS["gpu"], chunk_size=16, interpret=True),
    }[fn]
    batch = ragged_batch([4, 70, 1, 20], seed=4)
    want_out, want_state = jitted(reference.recurrent_gated_delta_rule)(*args_of(batch))
    head, tail = split(batch, 1, 37)
    out_head, state_head = run(*args_of(head))
    tail["initial_state"][1] = np.asarray(state_head)[0]
    out_tail, state_tail = run(*args_of(tail))
    a = int(batch["query_start_loc"][1])
    assert_close(out_head, np.asarray(want_out)[a : a + 37])
    keep = np.r_[0:a, a + 37 : len(batch["g"])]  # the second step's tokens
    assert_close(out_tail, np.asarray(want_out)[keep])
    assert_close(state_tail, want_state)


# ---- the Pallas kernels (interpret mode) against the reference ----

MIXED = [5, 1, 70, 1, 33]  # decodes and prefill chunks across chunk boundaries
CASES = {
    "mixed": (dict(lens=MIXED, dk=32, dv=16), {}),
    "decodes": (dict(lens=[1] * 6, pad_reqs=2, pad_tokens=2), {}),
    "all-padding": (dict(lens=[0], pad_reqs=2, pad_tokens=4), {}),
    "equal-heads": (dict(lens=[9, 1, 17], hk=4, hv=4), {}),
    "small-blocks": (
        dict(lens=[20, 9, 1, 40], hk=2, hv=8),
        dict(tpu=dict(chunk_size=8, key_heads_per_block=1), gpu=dict(chunk_size=8, block_v=4)),
    ),
}


def check_kernel(platform: str, batch: dict, dtype: str = "float32", **kwargs):
    """Kernel and reference on the same inputs (q, k, v rounded to ``dtype``): outputs
    and states close, padding tokens exactly zero, padding requests' states unchanged."""
    args = args_of(batch, jnp.dtype(dtype))
    want_out, want_state = jitted(reference.gated_delta_states)(*args)
    out, state = jitted(KERNELS[platform], interpret=True, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype) and state.dtype == jnp.float32
    real = int(batch["query_start_loc"][int(batch["num_seqs"])])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[real:], 0.0)
    np.testing.assert_array_equal(
        np.asarray(state)[int(batch["num_seqs"]) :],
        batch["initial_state"][int(batch["num_seqs"]) :],
    )
    if real:
        assert_close(out, want_out, TOLERANCE[dtype])
        assert_close(state, want_state, TOLERANCE[dtype])


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(platform, case):
    shape, options = CASES[case]
    check_kernel(platform, ragged_batch(**shape, seed=len(case)), **options.get(platform, {}))


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_kernel_never_reads_padding_tokens(platform):
    """NaN in every padding token's q, k, v, g and beta (the rows a last chunk reads
    past its request): the outputs are the same, and finite."""
    batch = ragged_batch([3, 1, 12], pad_tokens=9, seed=9)
    want = jitted(reference.gated_delta_states)(*args_of(batch))
    real = int(batch["query_start_loc"][-1])
    for name in ("q", "k", "v", "g", "beta"):
        batch[name][real:] = np.nan
    got = jitted(KERNELS[platform], interpret=True)(*args_of(batch))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    np.testing.assert_array_equal(np.asarray(got[0])[real:], 0.0)


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_kernel_matches_reference_in_bfloat16(platform):
    check_kernel(platform, ragged_batch(MIXED, seed=8), "bfloat16")


def test_block_tables():
    assert tpu.choose_blocks(64, 64, 4, 2, 128, 128, jnp.bfloat16, jnp.float32).chunk_size == 16
    prefill = tpu.choose_blocks(512, 16, 4, 2, 128, 128, jnp.bfloat16, jnp.float32)
    assert prefill == tpu.Blocks(chunk_size=64, key_heads_per_block=4)
    small = tpu.choose_blocks(512, 16, 16, 2, 128, 128, jnp.float32, jnp.float32, 8 << 20)
    assert small.key_heads_per_block == 8  # halved to fit, a multiple of 8 (HBM tiles)
    with pytest.raises(ValueError, match="multiple of 8"):
        batch = ragged_batch([3], hk=4, hv=8)
        KERNELS["tpu"](*args_of(batch), key_heads_per_block=2)
    with pytest.raises(ValueError, match="power of two >= 16"):
        KERNELS["gpu"](*args_of(ragged_batch([3])), chunk_size=8)


# ---- compiled for TPUs by libtpu, lowered for CUDA ----

# Qwen3-Next-80B's linear attention at TP 4 (16 key heads, 32 value heads, all of
# 128 features, split 4 ways) and whole (TP 1), bfloat16 tokens, float32 states
TP4, TP1 = (4, 8), (16, 32)


def abstract_args(tokens, requests, heads, placed=None, dtype=jnp.bfloat16):
    """The pool form's arguments: a pool of half as many rows again as requests (the
    engine's request slots and saved states)."""
    hk, hv = heads

    def shape(dims, dt=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dt, sharding=placed)

    return (
        shape((tokens, hk, 128), dtype),
        shape((tokens, hk, 128), dtype),
        shape((tokens, hv, 128), dtype),
        shape((tokens, hv), jnp.float32),
        shape((tokens, hv), jnp.float32),
        shape((requests + 1,)),
        shape(()),
        shape((requests + requests // 2, hv, 128, 128), jnp.float32),
        shape((requests,)),
        shape((requests,), jnp.bool_),
    )


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize(
    "tokens, requests, heads",
    [(64, 64, TP4), (512, 16, TP4), (64, 64, TP1)],
    ids=["decode-tp4", "prefill-tp4", "decode-tp1"],
)
def test_tpu_kernel_compiles(generation, tokens, requests, heads):
    """libtpu's Mosaic compiler takes the kernel at Qwen3-Next's dimensions with the
    generation's scoped VMEM (skipped where libtpu, the tpu extra, is absent)."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxengine.hardware import chip_named, slice_of
    from jaxengine.tpu_check.check import tpu_devices

    devices = tpu_devices(slice_of({"v5e": "v5e-4", "v6e": "v6e-1"}[generation]))
    placed = NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec())
    kernel = functools.partial(
        tpu.gated_delta_rule, vmem_limit_bytes=chip_named(generation).vmem_limit_bytes
    )
    compiled = jax.jit(kernel).lower(*abstract_args(tokens, requests, heads, placed)).compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize(
    "tokens, requests, heads",
    [(64, 64, TP4), (512, 16, TP4), (64, 64, TP1), (512, 16, TP1)],
    ids=["decode-tp4", "prefill-tp4", "decode-tp1", "prefill-tp1"],
)
def test_lowers_for_its_device(platform, tokens, requests, heads):
    """Pallas turns each kernel into its device's custom call (a Mosaic kernel, a
    Triton kernel) at Qwen3-Next's dimensions, without the device."""
    kernel = POOL_KERNELS["tpu" if platform == "tpu" else "gpu"]
    assert lowers_for(kernel, platform, *abstract_args(tokens, requests, heads))
