"""The on-device sampler: pure jax functions, jitted with `SamplerFlags` static.

`sample(logits[R, V], metadata, flags=...)` follows vLLM v1's order:

0. structured outputs: tokens outside a row's grammar bitmask -> -inf (vLLM masks
   the logits before its sampler, so even raw logprobs see the mask);
1. logprobs source: with `logprobs_mode="raw_logprobs"` (the default) the
   log_softmax of the raw logits, saved before anything else touches them;
2. allowed_token_ids: every token outside a row's allow-list -> -inf;
3. biases and bans: `logit_bias` values added, bad words and (below `min_tokens`)
   EOS / stop token ids -> -inf; then the custom logits processors that are not
   argmax invariant (``--logits-processors``, `jaxengine.logits_processor`);
4. penalties: repetition (tokens seen in prompt or output: positive logits divided
   by the penalty, negative ones multiplied), then frequency (minus freq * count in
   the output) and presence (minus pres * [count > 0]);
5. greedy rows: argmax of the logits after steps 2-4;
6. random rows: divide by temperature, min-p (drop tokens whose probability is below
   min_p * the top probability), the argmax-invariant custom processors (an
   all-greedy variant compiles none), top-k (keep the k largest, ties included), top-p
   (keep the smallest top set whose probability, renormalised after top-k, reaches
   p), then a Gumbel-max draw with the row's own key: argmax(logits + Gumbel noise)
   is an exact sample of softmax(logits);
7. logprobs (variants with `num_logprobs`): the sampled token's logprob and rank,
   the top-k, and with `logprob_ids_width` the logprobs and ranks of each row's
   `logprob_token_ids` (`gather_token_logprobs`).

Each row's key is `fold_in(threefry(seed), step)` and its noise is drawn per row
(vmap over keys), so a row's token does not depend on the other rows or its slot.
Without top-k/top-p rows (`filter_width == 0`) nothing is sorted; with top-k-only
rows the filter uses `lax.top_k(logits, filter_width)` instead of a full sort. A
filter variant sorts only in steps where a random row asks top-k or top-p
(`lax.cond`; padding rows ask neither), so a batch of temperature-only requests
that runs it pays for no sort.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxengine.runner.sampling_metadata import SamplerFlags, SamplingMetadata

_NEG_INF = -jnp.inf


class LogprobsOutput(NamedTuple):
    """Logprobs of the sampled tokens and the top-K tokens of each row."""

    sampled_logprob: jax.Array  # [R] f32
    sampled_rank: jax.Array  # [R] i32, 1-based: #tokens with logprob >= the sampled one
    topk_ids: jax.Array  # [R, K] i32, by decreasing logprob
    topk_logprobs: jax.Array  # [R, K] f32
    ids_logprobs: jax.Array | None = None  # [R, Kl] f32 of `logprob_ids` (flag set)
    ids_ranks: jax.Array | None = None  # [R, Kl] i32, 1-based, as `sampled_rank`


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [R] i32
    logprobs: LogprobsOutput | None  # None when flags.num_logprobs is None


# ------------------------------------------------------------ logits adjustments


def _scatter_rows(base: jax.Array, ids: jax.Array, values: jax.Array, op: str = "add") -> jax.Array:
    """base[r, ids[r, j]] (op)= values[r, j]; ids < 0 are padding and dropped."""
    R, V = base.shape
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], ids.shape)  # [R, K]
    cols = jnp.where(ids < 0, V, ids)  # [R, K], V is out of bounds -> dropped
    ref = base.at[rows, cols]
    return ref.set(values, mode="drop") if op == "set" else ref.add(values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in their row of `bitmask [R, ceil(V/32)]` -> -inf."""
    R, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]; arithmetic shift keeps bit 31
    allowed = bits.reshape(R, -1)[:, :V].astype(bool)  # [R, V]
    return jnp.where(allowed, logits, _NEG_INF)


def apply_allowed(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Rows with an allow-list keep only those tokens."""
    allowed = _scatter_rows(
        jnp.zeros(logits.shape, bool), md.allowed_ids, jnp.ones(md.allowed_ids.shape, bool), "set"
    )  # [R, V]
    return jnp.where(md.has_allowed[:, None] & ~allowed, _NEG_INF, logits)


def apply_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Adds each row's sparse bias (ids are unique per row; -inf values ban)."""
    return _scatter_rows(logits, md.bias_ids, md.bias_values)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition, frequency and presence penalties as vLLM (and OpenAI) define them."""
    R, L = md.penalty_ids.shape
    valid = md.penalty_ids >= 0  # [R, L]
    is_output = (jnp.arange(L)[None, :] < md.penalty_num_output[:, None]) & valid  # [R, L]
    zeros = jnp.zeros(logits.shape, jnp.int32)  # [R, V]
    out_counts = _scatter_rows(zeros, md.penalty_ids, is_output.astype(jnp.int32))  # [R, V]
    seen = _scatter_rows(zeros, md.penalty_ids, valid.astype(jnp.int32)) > 0  # [R, V]
    rep = md.repetition_penalty[:, None]  # [R, 1]
    scale = jnp.where(seen, jnp.where(logits > 0, 1.0 / rep, rep), 1.0)  # [R, V]
    logits = logits * scale
    logits = logits - md.frequency_penalty[:, None] * out_counts
    return logits - md.presence_penalty[:, None] * (out_counts > 0)


def apply_processors(
    logits: jax.Array, md: SamplingMetadata, processors: Sequence[Any], invariant: bool
) -> jax.Array:
    """The custom processors whose ``is_argmax_invariant()`` is ``invariant``, in their
    order, each with its own state from the metadata."""
    for proc, state in zip(processors, md.processor_states, strict=True):
        if bool(proc.is_argmax_invariant()) == invariant:
            logits = jnp.asarray(proc.apply(logits, state), jnp.float32)  # [R, V]
    return logits


def process_logits(
    logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags, processors: Sequence[Any] = ()
) -> jax.Array:
    """Steps 2-4 (allow-list, biases and bans, processors that may move the argmax,
    penalties); what greedy rows argmax."""
    logits = jnp.asarray(logits, jnp.float32)  # [R, V]
    if flags.allowed_width:
        logits = apply_allowed(logits, md)
    if flags.bias_width:
        logits = apply_bias(logits, md)
    logits = apply_processors(logits, md, processors, invariant=False)
    if flags.penalty_width:
        logits = apply_penalties(logits, md)
    return logits


# ------------------------------------------------------- temperature and filters


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
    return jnp.where(logits < top + jnp.log(min_p)[:, None], _NEG_INF, logits)


def apply_top_k_top_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, width: int
) -> jax.Array:
    """Top-k then top-p on the top `width` logits of each row (a full sort when
    `width == V`). Both become a per-row threshold on the logit value, so tokens
    tied with the last kept one are kept too."""
    width = min(width, logits.shape[-1])
    vals, _ = jax.lax.top_k(logits, width)  # [R, W], decreasing
    k = jnp.where(top_k > 0, jnp.minimum(top_k, width), width)  # [R]
    kth = jnp.take_along_axis(vals, (k - 1)[:, None], axis=1)[:, 0]  # [R]
    kth = jnp.where(top_k > 0, kth, _NEG_INF)
    vals = jnp.where(jnp.arange(width)[None, :] < k[:, None], vals, _NEG_INF)  # [R, W]
    probs = jax.nn.softmax(vals, axis=-1)  # [R, W]; exact: top-k support lies in W
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [R, W]
    n_keep = jnp.maximum(jnp.sum(mass_above < top_p[:, None], axis=-1), 1)  # [R]
    pth = jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=1)[:, 0]  # [R]
    pth = jnp.where(top_p < 1.0, pth, _NEG_INF)
    threshold = jnp.maximum(kth, pth)[:, None]  # [R, 1]
    return jnp.where(logits < threshold, _NEG_INF, logits)


def filter_logits(
    logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags, processors: Sequence[Any] = ()
) -> jax.Array:
    """Step 6 before the draw: temperature, min-p, the argmax-invariant processors,
    top-k, top-p (random rows)."""
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)  # [R]
    logits = logits / temperature[:, None]  # [R, V]
    logits = apply_min_p(logits, md.min_p)
    logits = apply_processors(logits, md, processors, invariant=True)
    if flags.filter_width:
        asked = ((md.top_k > 0) | (md.top_p < 1.0)) & (md.temperature > 0)  # [R]

        def top_k_top_p(x: jax.Array) -> jax.Array:
            return apply_top_k_top_p(x, md.top_k, md.top_p, flags.filter_width)

        logits = jax.lax.cond(jnp.any(asked), top_k_top_p, lambda x: x, logits)
    return logits


def row_keys(md: SamplingMetadata) -> jax.Array:
    """One threefry key per row from its seed and step: [R] keys."""

    def one(key_data: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        return jax.random.fold_in(key, step)

    return jax.vmap(one)(md.rng_key, md.rng_step)


def gumbel_noise(md: SamplingMetadata, vocab_size: int) -> jax.Array:
    """[R, V] standard Gumbel noise, each row from its own key only."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab_size,), jnp.float32))(row_keys(md))


# ---------------------------------------------------------------------- sampling


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    *,
    flags: SamplerFlags,
    processors: Sequence[Any] = (),
) -> SamplerOutput:
    """Samples one token per row of `logits [R, V]`; `flags` must be static, and
    ``processors`` (custom logits processors, one state each in
    ``md.processor_states``) are fixed for the compiled function."""
    logits = jnp.asarray(logits, jnp.float32)  # [R, V]
    if flags.token_bitmask:
        logits = apply_token_bitmask(logits, md.token_bitmask)
    raw = logits
    logits = process_logits(logits, md, flags, processors)  # [R, V]
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R]
    if flags.all_greedy:
        token_ids, final = greedy_ids, logits
    else:
        filtered = filter_logits(logits, md, flags, processors)  # [R, V]
        drawn = jnp.argmax(filtered + gumbel_noise(md, logits.shape[-1]), axis=-1)  # [R]
        is_greedy = md.temperature == 0  # [R]
        token_ids = jnp.where(is_greedy, greedy_ids, drawn.astype(jnp.int32))
        final = jnp.where(is_greedy[:, None], logits, filtered)
    if flags.num_logprobs is None:
        return SamplerOutput(token_ids, None)
    source = raw if flags.logprobs_mode.startswith("raw") else final
    if flags.logprobs_mode.endswith("logprobs"):
        source = jax.nn.log_softmax(source, axis=-1)
    out = gather_logprobs(source, token_ids, flags.num_logprobs)
    if flags.logprob_ids_width:
        out = out._replace(**gather_token_logprobs(source, md.logprob_ids))
    return SamplerOutput(token_ids, out)


def gather_logprobs(logprobs: jax.Array, token_ids: jax.Array, k: int) -> LogprobsOutput:
    """The chosen tokens' logprobs and 1-based ranks, and the top-k of each row."""
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)  # [N, 1]
    rank = jnp.sum(logprobs >= chosen, axis=-1).astype(jnp.int32)  # [N]
    k = min(k, logprobs.shape[-1])
    if k:
        top_vals, top_ids = jax.lax.top_k(logprobs, k)  # [N, k]
    else:
        top_vals = jnp.zeros((logprobs.shape[0], 0), logprobs.dtype)
        top_ids = jnp.zeros((logprobs.shape[0], 0), jnp.int32)
    return LogprobsOutput(chosen[:, 0], rank, top_ids.astype(jnp.int32), top_vals)


def gather_token_logprobs(logprobs: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
    """The logprobs and 1-based ranks of given ids (`ids [R, Kl]`, -1 padding) of
    each row of `logprobs [R, V]` (`logprob_token_ids`).

    The ranks take a sort of every row, so they are computed only when some row
    names ids (`lax.cond`): a batch of top-k requests pays for the gather alone.
    """
    values = jnp.take_along_axis(logprobs, jnp.maximum(ids, 0), axis=-1)  # [R, Kl]

    def ranks(_) -> jax.Array:
        ascending = jnp.sort(logprobs, axis=-1)  # [R, V]
        below = jax.vmap(lambda row, v: jnp.searchsorted(row, v, side="left"))(
            ascending, values
        )  # [R, Kl]: how many tokens are strictly less likely
        return (logprobs.shape[-1] - below).astype(jnp.int32)

    none = jnp.zeros(ids.shape, jnp.int32)
    rank = jax.lax.cond(jnp.any(ids >= 0), ranks, lambda _: none, None)
    return {"ids_logprobs": values, "ids_ranks": rank}


def prompt_logprobs(logits: jax.Array, target_ids: jax.Array, k: int) -> LogprobsOutput:
    """Scores prompt tokens: row t of `logits [T, V]` predicts `target_ids[t]`.

    Returns each target's logprob and rank and the top-`k` (static) of each row.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [T, V]
    return gather_logprobs(logprobs, target_ids.astype(jnp.int32), k)


sample_jit = jax.jit(sample, static_argnames=("flags",))
prompt_logprobs_jit = jax.jit(prompt_logprobs, static_argnames=("k",))
