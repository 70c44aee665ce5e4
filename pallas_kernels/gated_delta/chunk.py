"""One chunk of the gated delta rule for one head, as the Pallas kernels compute it.

`reference.chunk_step` is the spec; this is the same math on 2-D tiles with only
the operations both Mosaic (TPU) and Triton (GPU) lower: iotas, masks, reductions
along one axis, broadcasts and matmuls. Per-token scalars (``g``, ``beta``) come as
columns ``[C, 1]``; the row forms that the pairwise decay needs are built with a
masked reduction, not a transpose. The unit lower triangular solve (``(I + A)^-1``,
a triangular solve in the reference) is a block doubling: with ``X_s`` the inverse
of the diagonal blocks of size ``s``, ``X_2s = X_s - X_s M_s X_s`` where ``M_s``
holds ``A``'s entries below those blocks inside the blocks of size ``2s`` (the
block formula ``[[P, 0], [Q, R]]^-1 = [[P^-1, 0], [-R^-1 Q P^-1, R^-1]]`` for all
blocks at once). Six levels for ``C = 64``: twelve ``C x C`` matmuls, exact
arithmetic of forward substitution rather than a power series (whose terms cancel
badly when keys are correlated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta.reference import L2NORM_EPS

_MASKED = -1e30  # exp() of it is 0: the pairwise decay above the diagonal


def normalize(x: jax.Array, scale: float, use_l2norm: bool) -> jax.Array:
    """``x`` ``[C, D]`` in float32, L2-normalised per row (when asked) and scaled."""
    x = x.astype(jnp.float32)
    if use_l2norm:
        x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)
    return x * scale if scale != 1.0 else x


def _dot(a, b, precision, contract=((1,), (0,))):
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def unit_lower_inverse(a: jax.Array, precision=jax.lax.Precision.HIGHEST) -> jax.Array:
    """``(I + a)^-1`` for a strictly lower ``a`` ``[C, C]`` (C a power of two)."""
    size = a.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    col = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    inv = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    shift = 0
    while (1 << shift) < size:
        same_pair = jax.lax.shift_right_logical(row, shift + 1) == jax.lax.shift_right_logical(
            col, shift + 1
        )
        below = jax.lax.shift_right_logical(row, shift) > jax.lax.shift_right_logical(col, shift)
        m = jnp.where(same_pair & below, a, 0.0)
        inv = inv - _dot(_dot(inv, m, precision), inv, precision)
        shift += 1
    return inv


def chunk_step(q, k, v, g, beta, state, precision=jax.lax.Precision.HIGHEST):
    """One chunk: ``q``, ``k`` ``[C, Dk]`` (normalised, q scaled), ``v`` ``[C, Dv]``,
    ``g``, ``beta`` ``[C, 1]`` float32, ``state`` ``[Dk, Dv]`` float32 -> ``(out [C,
    Dv], state)``. Rows past the request's end must be zero in all five inputs."""
    size = g.shape[0]
    shape = (size, size)
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lower = col <= row
    g_row = jnp.sum(jnp.where(row == col, g, 0.0), axis=0, keepdims=True)  # [1, C]
    cum = jnp.sum(jnp.where(lower, g_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    cum_row = jnp.sum(jnp.where(row == col, cum, 0.0), axis=0, keepdims=True)  # [1, C]
    total = jnp.sum(g, axis=0, keepdims=True)  # [1, 1]
    decay = jnp.exp(jnp.where(lower, cum - cum_row, _MASKED))  # [C, C]

    kt = ((1,), (1,))  # x @ y^T
    a = jnp.where(col < row, beta * _dot(k, k, precision, kt) * decay, 0.0)
    inv = unit_lower_inverse(a, precision)
    u = _dot(inv, beta * v, precision)  # [C, Dv]
    w = _dot(inv, (beta * jnp.exp(cum)) * k, precision)  # [C, Dk]
    v_new = u - _dot(w, state, precision)
    attn = _dot(q, k, precision, kt) * decay
    out = _dot(jnp.exp(cum) * q, state, precision) + _dot(attn, v_new, precision)
    k_dec = jnp.exp(total - cum) * k  # [C, Dk]
    state = jnp.exp(total) * state + _dot(k_dec, v_new, precision, ((0,), (0,)))
    return out, state


def cost_estimate(q_shape, v_shape, initial_state, chunk: int, dtype=None):
    """Flops, exponentials and bytes of the chunked form (``pl.CostEstimate``):
    at most ``T // C + R`` chunks per value head, each the chunk step's matmuls;
    q, k, v, g, beta read once, the output written once, each state read and written."""
    num_tokens, num_k_heads, k_dim = q_shape
    num_v_heads, v_dim = v_shape[1:]
    num_reqs = initial_state.shape[0]
    item = jnp.dtype(dtype or jnp.float32).itemsize
    chunks = min(num_tokens, num_tokens // chunk + num_reqs) * num_v_heads
    products = chunk * chunk * (3 * k_dim + 2 * v_dim)  # k k^T, q k^T, W; U, attn V'
    inverse = 2 * (chunk.bit_length() - 1) * chunk**3  # two matmuls a doubling level
    with_state = 3 * chunk * k_dim * v_dim  # W S, q S, k^T V'
    per_chunk = 2 * (products + inverse + with_state)
    tokens = num_tokens * (2 * num_k_heads * k_dim + 2 * num_v_heads * v_dim) * item
    states = 2 * initial_state.size * initial_state.dtype.itemsize
    return pl.CostEstimate(
        flops=chunks * per_chunk,
        transcendentals=chunks * chunk * (chunk + 3),
        bytes_accessed=tokens + num_tokens * num_v_heads * 8 + states,
    )
