"""The gated delta rule over a ragged batch as a Pallas GPU kernel (Triton lowering).

Same signature and semantics as `reference.gated_delta_rule` (its reference; see
there for the math, the ragged layout and the padding rules); the chunk step is
`chunk.chunk_step`, tested against `reference.chunk_step`. Unlike the TPU kernel, this
one runs on gathered states (`gated_delta_states`, ``[R, Hv, Dk, Dv]``):
`gated_delta_rule` gathers the requests' rows of the pool before it and scatters them
back after it (XLA), one more read and write of each state than in place.

Work split. The grid is ``(requests, value heads, Dv / block_v)``: the rule is
independent per column of the value dimension (column ``j`` of the state only ever
meets column ``j`` of ``v``), so a program owns one request, one value head and
``block_v`` columns of its state ``[Dk, block_v]``, held in registers (float32)
across the request's chunks. It walks the request's new tokens ``chunk_size`` at a
time (a fori loop of ``cdiv(len, C)`` trips; a padding request runs none and copies
its state through): each chunk gathers its token rows with masked loads (``q``, ``k``
of key head ``h // (Hv // Hk)``, ``v``'s columns, ``g`` and ``beta``), so rows past
the request load as zeros and change nothing; the triangular solve and the other
``C x C`` work is recomputed per column block (small next to the state's matmuls).
Outputs leave by masked stores into a zero buffer (aliased), so padding tokens stay
zero. The state comes in from ``initial_state`` and is written back over it (aliased:
donate it and the update is in place).

Block sizes, from the shapes, overridable by keyword:

==============  ==============================================================
``chunk_size``  16 when the batch has at most two tokens per request (decode-
                like; ``tl.dot`` needs 16 rows), else 64
``block_v``     64 state columns (Dv if smaller): a ``[128, 64]`` float32 state
                is 64 registers a thread at 4 warps
``num_warps``   4, 8 for 64-token chunks
==============  ==============================================================

Dots run at ``precision`` (HIGHEST: IEEE float32, the reference's numbers; DEFAULT
lets Triton use TF32). ``Dk`` and ``block_v`` must be powers of two (Triton's
blocks), at least 16 when compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta import reference
from pallas_kernels.gated_delta.chunk import chunk_step, cost_estimate, normalize

PREFILL_CHUNK = 64
DECODE_CHUNK = 16
BLOCK_V = 64


def _kernel(
    qsl_ref,  # [R + 1]
    num_seqs_ref,  # [1]
    q_ref,  # [T * Hk, Dk]
    k_ref,  # [T * Hk, Dk]
    v_ref,  # [T * Hv, Dv]
    g_ref,  # [T * Hv] f32
    b_ref,  # [T * Hv] f32
    s_in_ref,  # [R * Hv * Dk, Dv], aliased to s_out_ref
    zeros_ref,  # [T * Hv, Dv], aliased to o_ref
    o_ref,  # [T * Hv, Dv]
    s_out_ref,  # [R * Hv * Dk, Dv]
    *,
    num_tokens: int,
    num_k_heads: int,
    num_v_heads: int,
    chunk: int,
    block_v: int,
    scale: float,
    use_qk_l2norm: bool,
    precision,
):
    del s_in_ref, zeros_ref  # the same buffers as s_out_ref and o_ref
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_dim = q_ref.shape[1]
    kh = h // (num_v_heads // num_k_heads)
    n = jnp.where(r < num_seqs_ref[0], qsl_ref[r + 1] - qsl_ref[r], 0)
    t0 = qsl_ref[r]

    d = jnp.arange(k_dim, dtype=jnp.int32)[None, :]  # [1, Dk]
    cols = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)[None, :]  # [1, BV]
    s_rows = (r * num_v_heads + h) * k_dim + jnp.arange(k_dim, dtype=jnp.int32)[:, None]
    state = plgpu.load(s_out_ref.at[s_rows, cols]).astype(jnp.float32)  # [Dk, BV]
    pos = jnp.arange(chunk, dtype=jnp.int32)

    def one_chunk(c, state):
        ok = pos < n - c * chunk  # [C]
        t_store = t0 + c * chunk + pos  # unclamped: masked rows never share a valid address
        t = jnp.minimum(t_store, num_tokens - 1)
        rows_ok = ok[:, None]
        qk_rows = (t * num_k_heads + kh)[:, None]
        q = plgpu.load(q_ref.at[qk_rows, d], mask=rows_ok, other=0.0)
        k = plgpu.load(k_ref.at[qk_rows, d], mask=rows_ok, other=0.0)
        v_rows = (t * num_v_heads + h)[:, None]
        v = plgpu.load(v_ref.at[v_rows, cols], mask=rows_ok, other=0.0).astype(jnp.float32)
        g = plgpu.load(g_ref.at[t * num_v_heads + h], mask=ok, other=0.0)[:, None]  # [C, 1]
        beta = plgpu.load(b_ref.at[t * num_v_heads + h], mask=ok, other=0.0)[:, None]
        q = normalize(q, scale, use_qk_l2norm)
        k = normalize(k, 1.0, use_qk_l2norm)
        out, state = chunk_step(q, k, v, g, beta, state, precision)
        o_rows = (t_store * num_v_heads + h)[:, None]
        plgpu.store(o_ref.at[o_rows, cols], out.astype(o_ref.dtype), mask=rows_ok)
        return state

    state = jax.lax.fori_loop(0, pl.cdiv(n, chunk), one_chunk, state)
    plgpu.store(s_out_ref.at[s_rows, cols], state.astype(s_out_ref.dtype))


def _check_block(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "use_qk_l2norm",
        "scale",
        "block_v",
        "num_warps",
        "precision",
        "interpret",
    ),
)
def gated_delta_states(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    initial_state: jax.Array,  # [R, Hv, Dk, Dv]
    *,
    chunk_size: int | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`reference.gated_delta_states` as one Triton kernel; returns ``(out [T, Hv, Dv],
    final_state [R, Hv, Dk, Dv])``. ``interpret=True`` runs it on CPU (blocks of any
    power of two). The state is updated in place when the caller donates it."""
    reference._check(q, k, v, g, beta, initial_state)
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    num_reqs = initial_state.shape[0]
    chunk, block_v = _blocks(q.shape, v.shape, num_reqs, chunk_size, block_v, interpret)
    kernel = functools.partial(
        _kernel,
        num_tokens=num_tokens,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        chunk=chunk,
        block_v=block_v,
        scale=k_dim**-0.5 if scale is None else scale,
        use_qk_l2norm=use_qk_l2norm,
        precision=precision,
    )
    call = _pallas_call(kernel, chunk, block_v, q, v, initial_state, num_warps, interpret)
    out, state = call(
        query_start_loc.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        q.reshape(num_tokens * num_k_heads, k_dim),
        k.reshape(num_tokens * num_k_heads, k_dim),
        v.reshape(num_tokens * num_v_heads, v_dim),
        g.astype(jnp.float32).reshape(-1),
        beta.astype(jnp.float32).reshape(-1),
        initial_state.reshape(num_reqs * num_v_heads * k_dim, v_dim),
        jnp.zeros((num_tokens * num_v_heads, v_dim), q.dtype),
    )
    return out.reshape(v.shape), state.reshape(initial_state.shape)


def gated_delta_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    state_pool: jax.Array,  # [S, Hv, Dk, Dv]
    state_rows: jax.Array,  # [R] int32, -1: padding
    fresh: jax.Array,  # [R] bool
    **options,
) -> tuple[jax.Array, jax.Array]:
    """`reference.gated_delta_rule` (the pool's rows) by `gated_delta_states` between a
    gather and a scatter of the rows; ``options``: `gated_delta_states`' keywords."""
    live = reference.live_requests(state_rows, num_seqs)
    initial = reference.read_rows(state_pool, state_rows, live & ~fresh)
    args = (q, k, v, g, beta, query_start_loc, num_seqs)
    out, final = gated_delta_states(*args, initial.astype(state_pool.dtype), **options)
    return out, reference.write_rows(state_pool, state_rows, live, final)


def _pallas_call(kernel, chunk, block_v, q, v, initial_state, num_warps, interpret):
    """The kernel's ``pallas_call`` over flat 2-D views (see `_kernel`'s arguments)."""
    num_tokens, num_v_heads, v_dim = v.shape
    num_reqs, _, k_dim, _ = initial_state.shape
    flat_out = jax.ShapeDtypeStruct((num_tokens * num_v_heads, v_dim), q.dtype)
    flat_state = (num_reqs * num_v_heads * k_dim, v_dim)
    return pl.pallas_call(
        kernel,
        out_shape=(flat_out, jax.ShapeDtypeStruct(flat_state, initial_state.dtype)),
        grid=(num_reqs, num_v_heads, v_dim // block_v),
        input_output_aliases={7: 1, 8: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (8 if chunk >= PREFILL_CHUNK else 4), num_stages=1
        ),
        cost_estimate=cost_estimate(q.shape, v.shape, initial_state, chunk, q.dtype),
        interpret=interpret,
        name="gated_delta_rule",
    )


def _blocks(q_shape, v_shape, num_reqs, chunk_size, block_v, interpret) -> tuple[int, int]:
    """``(chunk_size, block_v)``: the documented table (module docstring), checked."""
    num_tokens, _, k_dim = q_shape
    v_dim = v_shape[2]
    decode_like = num_tokens <= 2 * num_reqs
    chunk = chunk_size or (DECODE_CHUNK if decode_like else PREFILL_CHUNK)
    block_v = block_v or min(BLOCK_V, v_dim)
    minimum = 1 if interpret else 16  # tl.dot's smallest block
    for name, value in (("chunk_size", chunk), ("block_v", block_v), ("Dk", k_dim)):
        _check_block(name, value, minimum)
    if v_dim % block_v:
        raise ValueError(f"block_v {block_v} does not divide Dv {v_dim}")
    return chunk, block_v
