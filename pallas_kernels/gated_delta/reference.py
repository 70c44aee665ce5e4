"""Pure-jnp reference of Gated DeltaNet's token mixer over a ragged batch (Qwen3-Next,
Qwen3.5): the short causal depthwise convolution and the gated delta rule.

The math is transformers' ``modeling_qwen3_next`` (``torch_recurrent_gated_delta_rule``,
``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn`` / ``causal_conv1d_update``), for
a flat ragged batch instead of a padded one.

Ragged layout (the attention kernels' metadata): request ``r`` owns the new tokens
``query_start_loc[r]:query_start_loc[r + 1]``; requests ``>= num_seqs`` and tokens
``>= query_start_loc[num_seqs]`` are padding. Each request brings its state as of the
start of the step and gets it back as of its last new token: a prompt split over
several steps (chunked prefill, at any token) gives the result of one call. Padding
tokens come out as zeros; a padding request's state comes back unchanged. The
functions of the rule take each request's state gathered (``initial_state [R, ...]``);
`gated_delta_rule`, the kernels' signature, takes the pool of states and each
request's row in it (zeros for a new request) and writes the final states back there.

The gated delta rule, per value head, with the state ``S`` ``[Dk, Dv]`` and token
``t`` (``q``, ``k`` L2-normalised with ``rsqrt(sum(x*x) + 1e-6)``, then ``q`` scaled
by ``scale``, ``Dk ** -0.5`` by default; value head ``h`` reads key head
``h // (Hv // Hk)``, transformers' ``repeat_interleave``)::

    S   = exp(g_t) * S
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

`recurrent_gated_delta_rule` is this loop (the definition, and the decode form);
`chunked_gated_delta_rule` computes the same thing a chunk of ``C`` tokens at a time
(the prefill form): inside a chunk, with ``G_i`` the cumulative sum of ``g`` and
``D_ij = exp(G_i - G_j)`` for ``j <= i``, the strictly lower ``A_ij = beta_i k_i.k_j
D_ij`` gives ``U = (I + A)^-1 (beta v)`` and ``W = (I + A)^-1 (beta exp(G) k)``; then
``V' = U - W S``, ``O = (exp(G) q) S + (q k^T * D)_{j<=i} V'`` and ``S = exp(G_C) S +
(exp(G_C - G) k)^T V'``. A request's chunks start at its own first token, so the
two forms agree however a prompt is split. All of it runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6  # transformers' l2norm: x * rsqrt(sum(x * x) + eps)
_HI = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x * x, -1) + 1e-6)`` in float32 (transformers' ``l2norm``)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_qk(q, k, num_v_heads: int, use_qk_l2norm: bool, scale: float | None):
    """q and k as the rule reads them: float32, L2-normalised (when asked), q scaled,
    and repeated to one key head per value head (``[T, Hv, Dk]``)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    ratio = num_v_heads // q.shape[1]
    return jnp.repeat(q, ratio, axis=1), jnp.repeat(k, ratio, axis=1)


def request_lengths(query_start_loc: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """New tokens per request, 0 for the padding requests (``r >= num_seqs``)."""
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    return jnp.where(jnp.arange(lengths.shape[0]) < num_seqs, lengths, 0).astype(jnp.int32)


def _check(q, k, v, g, beta, initial_state):
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: Hv must be a multiple of Hk")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [T, Hv]")
    if initial_state.shape[1:] != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"initial_state {initial_state.shape}: want [R, Hv, Dk, Dv]")


def _gather_rows(x: jax.Array, idx: jax.Array, ok: jax.Array) -> jax.Array:
    """``x[idx]`` as float32 with the rows where ``ok`` is False set to zero."""
    rows = x[jnp.clip(idx, 0, x.shape[0] - 1)].astype(jnp.float32)
    return jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - ok.ndim)), rows, 0.0)


def _put_rows(out: jax.Array, rows: jax.Array, idx: jax.Array, ok: jax.Array) -> jax.Array:
    """``out[idx] = rows`` where ``ok``; the other rows are dropped."""
    return out.at[jnp.where(ok, idx, out.shape[0])].set(rows.astype(out.dtype), mode="drop")


def recurrent_gated_delta_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv] log decay (<= 0)
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    initial_state: jax.Array,  # [R, Hv, Dk, Dv]
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (the definition); returns ``(out [T, Hv, Dv]
    in q's dtype, final_state [R, Hv, Dk, Dv] in initial_state's dtype)``.

    All requests advance together: step ``i`` takes every request's ``i``-th new
    token, so the trip count is the longest request (one step for a decode batch).
    """
    _check(q, k, v, g, beta, initial_state)
    num_v_heads = g.shape[1]
    qh, kh = prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale)  # [T, Hv, Dk]
    starts = query_start_loc[:-1].astype(jnp.int32)
    lengths = request_lengths(query_start_loc, num_seqs)  # [R]

    def step(i, carry):
        state, out = carry  # [R, Hv, Dk, Dv], [R, L, Hv, Dv]
        ok = i < lengths  # [R]
        idx = starts + i
        q_t, k_t = _gather_rows(qh, idx, ok), _gather_rows(kh, idx, ok)  # [R, Hv, Dk]
        v_t = _gather_rows(v, idx, ok)  # [R, Hv, Dv]
        g_t, b_t = _gather_rows(g, idx, ok), _gather_rows(beta, idx, ok)  # [R, Hv]
        state = state * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("rhkv,rhk->rhv", state, k_t, precision=_HI)
        delta = (v_t - kv_mem) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("rhkv,rhk->rhv", state, q_t, precision=_HI)
        return state, _put_rows(out, o_t, idx, ok)

    state = initial_state.astype(jnp.float32)
    out = jnp.zeros(v.shape, jnp.float32)  # padding tokens stay zero
    state, out = jax.lax.fori_loop(0, jnp.max(lengths, initial=0), step, (state, out))
    return out.astype(q.dtype), state.astype(initial_state.dtype)


def unit_lower_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    """``(I + a)^-1 b`` for strictly lower ``a`` ``[..., C, C]`` (transformers'
    ``solve_triangular(..., unitriangular=True)``)."""
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    return jax.lax.linalg.triangular_solve(
        a + eye, b, left_side=True, lower=True, unit_diagonal=True
    )


def chunk_step(q, k, v, g, beta, state):
    """One chunk of every request: ``q``, ``k`` ``[..., C, Dk]`` (prepared), ``v``
    ``[..., C, Dv]``, ``g``, ``beta`` ``[..., C]`` (rows past a request's end all zero:
    they change nothing), ``state`` ``[..., Dk, Dv]`` -> ``(out [..., C, Dv], state)``."""
    chunk = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # [..., C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)  # [..., C, C], zero above the diagonal
    ein = lambda spec, x, y: jnp.einsum(spec, x, y, precision=_HI)  # noqa: E731
    kk = ein("...ik,...jk->...ij", k, k)
    a = jnp.where(lower & ~jnp.eye(chunk, dtype=bool), beta[..., :, None] * kk * decay, 0.0)
    u = unit_lower_solve(a, beta[..., None] * v)  # [..., C, Dv]
    w = unit_lower_solve(a, (beta * jnp.exp(cum))[..., None] * k)  # [..., C, Dk]
    v_new = u - ein("...ck,...kv->...cv", w, state)
    attn = ein("...ik,...jk->...ij", q, k) * decay
    out = ein("...ck,...kv->...cv", q * jnp.exp(cum)[..., None], state)
    out = out + ein("...ij,...jv->...iv", attn, v_new)
    total = cum[..., -1:]  # [..., 1]
    k_dec = k * jnp.exp(total - cum)[..., None]
    state = state * jnp.exp(total)[..., None] + ein("...ck,...cv->...kv", k_dec, v_new)
    return out, state


def chunked_gated_delta_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    initial_state: jax.Array,  # [R, Hv, Dk, Dv]
    *,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule a chunk at a time (`chunk_step`), same result as
    `recurrent_gated_delta_rule`. Step ``j`` takes chunk ``j`` of every request
    (tokens ``start + j*C ...``), so the trip count is the most chunks of a request."""
    _check(q, k, v, g, beta, initial_state)
    num_v_heads = g.shape[1]
    qh, kh = prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale)  # [T, Hv, Dk]
    starts = query_start_loc[:-1].astype(jnp.int32)
    lengths = request_lengths(query_start_loc, num_seqs)  # [R]
    pos = jnp.arange(chunk_size)
    heads_first = lambda x: jnp.moveaxis(x, 2, 1)  # [R, C, Hv, ...] -> [R, Hv, C, ...]  # noqa: E731

    def step(j, carry):
        state, out = carry
        i = j * chunk_size + pos  # [C]
        ok = i[None, :] < lengths[:, None]  # [R, C]
        idx = starts[:, None] + i[None, :]
        rows = [heads_first(_gather_rows(x, idx, ok)) for x in (qh, kh, v)]
        g_c, b_c = (_gather_rows(x, idx, ok).swapaxes(1, 2) for x in (g, beta))  # [R, Hv, C]
        o, state = chunk_step(*rows, g_c, b_c, state)
        return state, _put_rows(out, jnp.moveaxis(o, 1, 2), idx, ok)  # o: [R, C, Hv, Dv]

    state = initial_state.astype(jnp.float32)
    out = jnp.zeros(v.shape, jnp.float32)  # padding tokens stay zero
    most = (jnp.max(lengths, initial=0) + chunk_size - 1) // chunk_size
    state, out = jax.lax.fori_loop(0, most, step, (state, out))
    return out.astype(q.dtype), state.astype(initial_state.dtype)


def choose_chunk(num_tokens: int, num_reqs: int) -> int | None:
    """The form a batch shape gets: None (token by token) when it holds at most two
    tokens per request (decode-like), else chunks of 64."""
    return None if num_tokens <= 2 * num_reqs else 64


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
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a ragged batch of gathered states: one initial state
    per request in, its final state out (`gated_delta_rule` takes the pool instead):
    `chunked_gated_delta_rule` with ``chunk_size``, or, when None, the form
    `choose_chunk` gives the batch shape. Returns ``(out, final_state)``."""
    if chunk_size is None:
        chunk_size = choose_chunk(q.shape[0], initial_state.shape[0])
    options = dict(use_qk_l2norm=use_qk_l2norm, scale=scale)
    args = (q, k, v, g, beta, query_start_loc, num_seqs, initial_state)
    if chunk_size is None:
        return recurrent_gated_delta_rule(*args, **options)
    return chunked_gated_delta_rule(*args, chunk_size=chunk_size, **options)


def live_requests(state_rows: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """``[R]`` bool: the requests that own a pool row (``r < num_seqs`` and
    ``state_rows[r] >= 0``); the others are padding and write no row."""
    return (jnp.arange(state_rows.shape[0]) < num_seqs) & (state_rows >= 0)


def read_rows(pool: jax.Array, rows: jax.Array, keep: jax.Array) -> jax.Array:
    """``pool[rows]`` in float32 ``[R, ...]``, zeros where ``keep`` is False."""
    return _gather_rows(pool, rows, keep)


def write_rows(pool: jax.Array, rows: jax.Array, keep: jax.Array, states: jax.Array) -> jax.Array:
    """``pool`` with ``pool[rows[r]] = states[r]`` where ``keep[r]``; other rows as they were."""
    return _put_rows(pool, states, rows, keep)


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
    *,
    chunk_size: int | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a ragged batch with its states in a pool (the
    kernels' signature; the CPU path). Request ``r`` starts from
    ``state_pool[state_rows[r]]``, from zeros where ``fresh[r]``, and its final state
    lands in that row; a request that is not live (`live_requests`: past ``num_seqs``
    or ``state_rows[r] < 0``) starts from zeros and writes nothing. Rows no live
    request names come back unchanged; live requests name distinct rows. Returns
    ``(out [T, Hv, Dv], new pool)``. Here by gather and scatter (`gated_delta_states`);
    the TPU kernel reads and writes the rows in place."""
    live = live_requests(state_rows, num_seqs)
    initial = read_rows(state_pool, state_rows, live & ~fresh)
    options = dict(chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm, scale=scale)
    args = (q, k, v, g, beta, query_start_loc, num_seqs)
    out, final = gated_delta_states(*args, initial, **options)
    return out, write_rows(state_pool, state_rows, live, final.astype(state_pool.dtype))


def _token_requests(query_start_loc, num_seqs, num_tokens: int):
    """Each flat token's request, its index among the request's new tokens, and
    whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_reqs = query_start_loc.shape[0] - 1
    req = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)
    return req, t - query_start_loc[req], t < query_start_loc[num_seqs]


def causal_conv1d(
    x: jax.Array,  # [T, C]
    weight: jax.Array,  # [C, K]
    bias: jax.Array | None,  # [C]
    conv_state: jax.Array,  # [R, K - 1, C]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution over a ragged batch; returns ``(y [T, C] in
    x's dtype, new conv_state [R, K - 1, C])``.

    ``weight`` is the checkpoint's ``conv1d.weight`` ``[C, 1, K]`` squeezed: ``y_t =
    act(bias + sum_k weight[:, k] * x_{t - (K-1) + k})`` (``weight[:, K-1]`` meets the
    token itself), where inputs before the request's first new token come from its
    ``conv_state``: its last ``K - 1`` inputs, oldest first (zeros for a new request).
    The new state is the last ``K - 1`` inputs after this step's tokens (a request
    with fewer than ``K - 1`` new tokens keeps the tail of its old state); a padding
    request's state comes back unchanged, padding tokens come out as zeros.
    transformers keeps ``K`` inputs (``causal_conv1d_update``), the oldest never read.
    Accumulates in float32; ``activation``: "silu" (Qwen3-Next's ``hidden_act``) or None.
    """
    num_tokens, channels = x.shape
    taps = weight.shape[1]
    if weight.shape[0] != channels or conv_state.shape[1:] != (taps - 1, channels):
        raise ValueError(f"x {x.shape}, weight {weight.shape}, conv_state {conv_state.shape}")
    req, i, valid = _token_requests(query_start_loc, num_seqs, num_tokens)
    xf, state = x.astype(jnp.float32), conv_state.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    y = jnp.zeros((num_tokens, channels), jnp.float32) if bias is None else (
        jnp.broadcast_to(bias.astype(jnp.float32), (num_tokens, channels))
    )  # fmt: skip
    t = jnp.arange(num_tokens)
    for tap in range(taps):
        back = taps - 1 - tap  # how many tokens before this one the tap reads
        from_x = xf[jnp.maximum(t - back, 0)]
        from_state = state[req, jnp.clip(taps - 1 + i - back, 0, taps - 2)]
        y = y + w[:, tap] * jnp.where((i >= back)[:, None], from_x, from_state)
    if activation == "silu":
        y = jax.nn.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    y = jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
    return y, _conv_state_after(xf, state, query_start_loc, num_seqs).astype(conv_state.dtype)


def _conv_state_after(x, state, query_start_loc, num_seqs):
    """Each request's last ``K - 1`` inputs after its new tokens ``[R, K - 1, C]``."""
    keep = state.shape[1]
    lengths = request_lengths(query_start_loc, num_seqs)[:, None]  # [R, 1]
    p = lengths - keep + jnp.arange(keep)[None, :]  # [R, K-1] position among new tokens
    from_x = x[jnp.clip(query_start_loc[:-1, None] + p, 0, x.shape[0] - 1)]
    old = jnp.take_along_axis(
        state, jnp.clip(lengths + jnp.arange(keep), 0, keep - 1)[..., None], 1
    )
    return jnp.where((p >= 0)[..., None], from_x, old)
