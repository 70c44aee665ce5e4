"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5, over the
engine's ragged batch, with its per-request state beside the paged KV cache.

A linear-attention layer's cache entry is not pages but two state pools with one slot
per running request (`state_shapes`): the causal convolution's window, flat and
channel-major ``[S, conv_dim * (K - 1)]`` (`conv_window`), and the delta rule's state
``[S, Hv, Dk, Dv]``, both float32. Each request's row is ``md.state_rows`` (``-1``: a
padding request); a request whose context this step is empty (``seq_len - q_len ==
0``: a new request, or one re-prefilled after a recompute preemption) starts from
zeros. The convolution gathers its windows' rows and writes them back
(``state_write_fn``: in place by DMA on TPU, `pallas_kernels.gated_delta.rows`); the rule
(`pallas_kernels.gated_delta`) takes the state pool and the rows, and on TPU reads
and writes each request's row in place, so chunked prefill carries a prompt's state
from chunk to chunk and a decode step reads and writes each running request's state
once.

The window's pool is 2-D so that its rows are lane-dense on TPU: laid out ``[S, K -
1, conv_dim]``, the ``K - 1 = 3`` axis fills no sublane tile, and XLA's TPU layout of
the pool moved it out of the way (``{2,0,1}``), which every gather and scatter of rows
then copied the whole pool to undo (the audit of `jaxengine.tpu_check`). Channel-major
(each channel's ``K - 1`` inputs together) keeps a tensor shard's columns its own
channels: the pool splits over ``tensor`` like the layer's channels.

The layer's tensors follow Qwen3.5's checkpoint (``in_proj_qkv`` rows ``[q; k; v]``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d.weight [conv_dim, 1, K]``,
``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj``); Qwen3-Next's interleaved
``in_proj_qkvz`` / ``in_proj_ba`` are rearranged into them at load time
(`models.qwen3_next.split_tensors`). The math is transformers'
``Qwen3NextGatedDeltaNet``: ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
dt_bias)``, the rule with L2-normalised q and k, then an RMS norm of each value head
(plain ``weight``, not zero-centred) gated by ``silu(z)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Linear
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.metadata import AttentionMetadata
from pallas_kernels.gated_delta import reference as gdn


@dataclasses.dataclass(frozen=True)
class GatedDeltaSpec:
    """The shapes of a model's Gated DeltaNet layers."""

    num_k_heads: int
    """Query/key heads Hk (``linear_num_key_heads``)."""
    num_v_heads: int
    """Value heads Hv (``linear_num_value_heads``), a multiple of Hk."""
    head_k_dim: int
    """Dk (``linear_key_head_dim``)."""
    head_v_dim: int
    """Dv (``linear_value_head_dim``)."""
    conv_kernel: int = 4
    """Taps K of the causal depthwise convolution (``linear_conv_kernel_dim``)."""

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads or self.conv_kernel < 2:
            raise ValueError(f"invalid Gated DeltaNet shapes: {self}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def shapes(self, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's (conv window, delta-rule state) pool shapes for ``slots`` requests:
        ``[slots, conv_dim * (K - 1)]`` (channel-major, `conv_window`) and ``[slots, Hv,
        Dk, Dv]``."""
        conv = (slots, self.conv_dim * (self.conv_kernel - 1))
        return conv, (slots, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def bytes_per_request(self) -> int:
        """float32 bytes of one request's state in one layer."""
        conv, ssm = self.shapes(1)
        return 4 * (math.prod(conv) + math.prod(ssm))


STATE_DTYPE = jnp.float32
CHUNK = 16
"""Tokens per chunk of the delta rule's chunked form (a batch of more than two tokens
a request; the recurrent form otherwise, `gdn.choose_chunk`). Exact at any size; on
XLA's CPU backend 16-token chunks ran a 32-token step in ~0.2 ms where 64-token ones
took 1-250 ms (their larger solves and matmuls stall on a busy thread pool)."""


def reference_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    state_pool: jax.Array,  # [S, Hv, Dk, Dv]
    state_rows: jax.Array,  # [R] int32
    fresh: jax.Array,  # [R] bool
) -> tuple[jax.Array, jax.Array]:
    """The layer's default rule (the CPU path, `runner.attention_backend`): the
    reference, token by token on decode-like batches and in ``CHUNK``-token chunks
    otherwise. The kernels take the same arguments and choose their own chunks."""
    chunk = gdn.choose_chunk(q.shape[0], state_rows.shape[0]) and CHUNK
    args = (q, k, v, g, beta, query_start_loc, num_seqs, state_pool, state_rows, fresh)
    return gdn.gated_delta_rule(*args, chunk_size=chunk)


def layer_state_shapes(config: TransformerConfig, slots: int) -> tuple | None:
    """Per layer: its state pools' shapes (a linear-attention layer: ``spec.linear``)
    or None (a paged attention layer); None for a model without linear attention
    (``config.family_spec.gated_delta`` absent)."""
    spec = getattr(config.family_spec, "gated_delta", None)
    if spec is None:
        return None
    return tuple(spec.shapes(slots) if getattr(s, "linear", False) else None for s in config.layers)


def conv_window(rows: jax.Array, conv_kernel: int) -> jax.Array:
    """Rows of the window pool ``[R, C * (K - 1)]`` as windows ``[R, K - 1, C]``."""
    num_rows = rows.shape[0]
    return rows.reshape(num_rows, -1, conv_kernel - 1).swapaxes(1, 2)


def conv_rows(windows: jax.Array) -> jax.Array:
    """Windows ``[R, K - 1, C]`` as rows of the window pool ``[R, C * (K - 1)]``."""
    return windows.swapaxes(1, 2).reshape(windows.shape[0], -1)


def fresh_requests(md: AttentionMetadata) -> jax.Array:
    """``[R]`` bool: requests with no context before this step (start from zeros)."""
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    return (md.seq_lens - q_lens) <= 0


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer: ``(x [T, H], (conv_pool, ssm_pool), md) ->
    (out [T, H], new pools)``. Heads name the ``q_heads`` logical axis, so tensor
    parallelism splits them like attention heads. ``gated_delta_fn``: the rule (the
    backend's, `runner.attention_backend.gated_delta_kernel`; the reference by default);
    ``state_write_fn``: the convolution windows' write (``(pool, rows, keep, states) ->
    pool``, the backend's; `pallas_kernels.gated_delta.reference.write_rows` by default)."""

    config: TransformerConfig
    spec: GatedDeltaSpec
    gated_delta_fn: Callable[..., tuple[jax.Array, jax.Array]] = reference_rule
    state_write_fn: Callable[..., jax.Array] = gdn.write_rows

    @nn.compact
    def __call__(self, x: jax.Array, state: tuple[jax.Array, jax.Array], md: AttentionMetadata):
        cfg, spec = self.config, self.spec
        num_tokens, hv = x.shape[0], spec.num_v_heads
        lin = dict(dtype=cfg.dtype, weight_dtype=cfg.matmul_dtype)
        qkv = Linear(spec.conv_dim, ("mlp", "embed"), name="in_proj_qkv", **lin)(x)
        z = Linear(spec.value_dim, ("q_heads", "embed"), name="in_proj_z", **lin)(x)
        b = Linear(hv, ("q_heads", "embed"), name="in_proj_b", **lin)(x)
        a = Linear(hv, ("q_heads", "embed"), name="in_proj_a", **lin)(x)
        conv_w = _param("conv1d", "weight", (spec.conv_dim, 1, spec.conv_kernel), cfg.dtype)
        a_log = self.param("A_log", _init(nn.initializers.zeros, ("q_heads",)), (hv,), cfg.dtype)
        dt_bias = self.param("dt_bias", _init(nn.initializers.ones, ("q_heads",)), (hv,), cfg.dtype)

        conv_pool, ssm_pool = state
        rows, fresh = md.state_rows, fresh_requests(md)
        qsl, num_seqs = md.query_start_loc, md.num_seqs
        live = gdn.live_requests(rows, num_seqs)
        conv0 = conv_window(gdn.read_rows(conv_pool, rows, live & ~fresh), spec.conv_kernel)
        mixed, conv1 = gdn.causal_conv1d(qkv, conv_w[:, 0, :], None, conv0, qsl, num_seqs)
        q, k, v = jnp.split(mixed, [spec.key_dim, 2 * spec.key_dim], axis=-1)
        q = q.reshape(num_tokens, spec.num_k_heads, spec.head_k_dim)
        k = k.reshape(num_tokens, spec.num_k_heads, spec.head_k_dim)
        v = v.reshape(num_tokens, hv, spec.head_v_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [T, Hv]
        decay = jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        g = -jnp.exp(a_log.astype(jnp.float32)) * decay  # [T, Hv] log decay
        out, ssm_pool = self.gated_delta_fn(q, k, v, g, beta, qsl, num_seqs, ssm_pool, rows, fresh)
        norm_w = _param("norm", "weight", (spec.head_v_dim,), cfg.dtype, nn.initializers.ones)
        out = gated_rms_norm(out, z.reshape(out.shape), norm_w, cfg.rms_norm_eps)
        out_proj = Linear(cfg.hidden_size, ("embed", "q_heads"), name="out_proj", **lin)
        y = out_proj(out.reshape(num_tokens, spec.value_dim).astype(x.dtype))
        conv_pool = self.state_write_fn(conv_pool, rows, live, conv_rows(conv1))
        return y, (conv_pool, ssm_pool)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' ``RMSNormGated``: ``weight * rms_norm(x) * silu(gate)`` over the
    last axis, in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf * weight.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))


def _init(init: Any, axes: tuple) -> Any:
    return nn.with_logical_partitioning(init, axes)


def _param(scope: str, name: str, shape: tuple, dtype, init=None) -> jax.Array:
    """A parameter ``{scope}.{name}`` of the calling module (a checkpoint's
    ``conv1d.weight``, ``norm.weight``), held by a one-parameter submodule named
    ``scope``; call it from a compact method, which the submodule binds to."""
    init = init or nn.initializers.normal(0.02)
    axes = ("q_heads",) + (None,) * (len(shape) - 1) if scope == "conv1d" else ("norm",)
    return _Holder(name, shape, dtype, _init(init, axes), name=scope)()


class _Holder(nn.Module):
    """A submodule that only holds one parameter (``conv1d.weight``, ``norm.weight``)."""

    leaf: str
    shape: tuple
    dtype: Any
    init: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(self.leaf, self.init, self.shape, self.dtype)
