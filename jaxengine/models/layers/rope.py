"""Rotary position embeddings: the inverse frequencies of each scaling variant.

Frequencies are computed on the host in numpy (they are constants of the config) and
applied in the jitted forward. The rotation is the "rotate half" form used by every
supported family's Hugging Face checkpoint.

LongRoPE (Phi-3 / Phi-4, ``rope_type`` "longrope") divides each frequency by a
per-frequency factor and scales cos/sin by an attention factor (`_longrope_scale`, as
transformers computes it). Which factors, ``short_factor`` or ``long_factor``, is fixed
per engine, as vLLM fixes it (since vllm-project/vllm#27431): ``long_factor`` when the
engine's context length (``--max-model-len``, by default the checkpoint's
``max_position_embeddings``) exceeds ``original_max_position_embeddings``, else
``short_factor`` (`RopeSpec.longrope_long`, set by `rope_from_hf` and
`layers.config.with_context_length`). transformers chooses per forward instead:
``long_factor`` for every position once the forward's longest sequence exceeds the
original length. The two agree exactly for a sequence longer than the original
length in a long-context engine, and for any sequence in an engine whose context is
within it; they differ for a short sequence in a long-context engine. Switching per
sequence as it grows would leave its cached keys rotated by the other factors, so a
cached engine keeps one set for its lifetime.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.layers.config import RopeSpec


def _default(spec: RopeSpec, dim: int) -> np.ndarray:
    return 1.0 / (spec.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(spec: RopeSpec, dim: int) -> np.ndarray:
    inv_freq = _default(spec, dim)
    old_len = spec.original_max_position_embeddings
    low_wavelen = old_len / spec.low_freq_factor
    high_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _dynamic(spec: RopeSpec, dim: int) -> np.ndarray:
    # Fixed NTK scaling at the extended length original * factor (as vLLM does);
    # transformers instead recomputes the base from each batch's current length.
    orig = spec.original_max_position_embeddings
    max_len = orig * spec.factor
    base = spec.theta * ((spec.factor * max_len / orig) - (spec.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _yarn(spec: RopeSpec, dim: int) -> np.ndarray:
    orig = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:  # transformers' default; gpt-oss keeps the fractional ends
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = _default(spec, dim)
    interpolation = extrapolation / spec.factor
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope(spec: RopeSpec, dim: int) -> np.ndarray:
    """``1 / (factor_i * theta ** (2i / dim))`` with the engine's factors (module doc)."""
    factors = spec.long_factor if spec.longrope_long else spec.short_factor
    if factors is None or len(factors) != dim // 2:
        kind = "long_factor" if spec.longrope_long else "short_factor"
        raise ValueError(f"longrope needs a {kind} of {dim // 2} values (rot_dim / 2)")
    return 1.0 / (np.asarray(factors, np.float64) * spec.theta ** (np.arange(0, dim, 2) / dim))


def _longrope_scale(spec: RopeSpec) -> float:
    """The cos/sin scale: ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(orig))``
    for a ``factor`` above 1 (`rope_from_hf` derives ``factor`` as transformers does:
    ``max_position_embeddings / original_max_position_embeddings`` when absent)."""
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_position_embeddings))


def _proportional(spec: RopeSpec, dim: int) -> np.ndarray:
    """Gemma 4's full-attention layers: ``dim`` is the whole head, which rotates (pairs
    ``i``, ``i + dim / 2``); the first ``partial_rotary_factor * dim / 2`` frequencies
    are the default ones and the rest zero (those pairs stay put), all over ``factor``."""
    rotated = int(spec.partial_rotary_factor * dim // 2)
    inv_freq = np.zeros(dim // 2, np.float64)
    inv_freq[:rotated] = 1.0 / (spec.theta ** (np.arange(0, 2 * rotated, 2) / dim))
    return inv_freq / spec.factor


_VARIANTS = {
    "default": _default,
    "proportional": _proportional,
    "linear": lambda spec, dim: _default(spec, dim) / spec.factor,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def inv_freq_and_scale(spec: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[rot_dim // 2]`` and the cos/sin scale of a rope spec."""
    rot_dim = int(head_dim * spec.partial_rotary_factor)
    if spec.rope_type == "proportional":  # its zero frequencies do the partial rotation
        rot_dim = head_dim
    if spec.rope_type not in _VARIANTS:
        raise ValueError(
            f"unsupported rope_type {spec.rope_type!r}; supported: {sorted(_VARIANTS)}"
        )
    inv_freq = _VARIANTS[spec.rope_type](spec, rot_dim)
    scale = 1.0
    if spec.rope_type == "yarn":
        if spec.attention_factor is not None:
            scale = spec.attention_factor
        elif spec.factor > 1:
            scale = 0.1 * math.log(spec.factor) + 1.0
    elif spec.rope_type == "longrope":
        scale = _longrope_scale(spec)
    return inv_freq.astype(np.float32), float(scale)


def apply_rope(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # [T]
    spec: RopeSpec,
) -> jax.Array:
    """Rotates the first ``rot_dim`` features of each head by its position."""
    inv_freq, scale = inv_freq_and_scale(spec, x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    if spec.interleaved:  # Llama 4: adjacent feature pairs
        return _rotate_pairs(x, angles, scale)
    return _rotate(x, angles, scale)


def apply_mrope(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # [3, T] int: (temporal, height, width) rows
    spec: RopeSpec,
) -> jax.Array:
    """M-RoPE (Qwen2.5-VL): frequency ``j`` rotates by the position row of its section
    of ``spec.mrope_section`` (sections cycle t, h, w; interleaved rows in Qwen3.5:
    `_mrope_rows`), as transformers' ``Qwen2_5_VLRotaryEmbedding`` with
    ``apply_rotary_pos_emb``. Equal rows give the
    1-D rope of ``spec``."""
    inv_freq, scale = inv_freq_and_scale(spec, x.shape[-1])
    section = spec.mrope_section
    if sum(section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {section} must sum to {inv_freq.shape[0]} (rot_dim / 2)")
    rows = _mrope_rows(section, spec.mrope_interleaved)  # [rot/2]: row of each frequency
    angles = positions.astype(jnp.float32)[rows].T * jnp.asarray(inv_freq)  # [T, rot/2]
    return _rotate(x, angles, scale)


def _mrope_rows(section: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """The position row (0: t, 1: h, 2: w) of each of the ``sum(section)`` frequencies:
    contiguous sections cycling t, h, w, or (``interleaved``, transformers'
    ``Qwen3_5TextRotaryEmbedding``) ``t, h, w, t, h, w, ...`` while each row lasts."""
    if not interleaved:
        return np.repeat(np.arange(len(section)) % 3, section)
    j = np.arange(sum(section))
    rows = np.zeros_like(j)
    for row in (1, 2):
        rows[(j % 3 == row) & (j < 3 * section[row])] = row
    return rows


def _rotate(x: jax.Array, angles: jax.Array, scale: float) -> jax.Array:
    """Rotate-half of the first ``2 * angles.shape[-1]`` features of ``x [T, H, D]`` by
    ``angles [T, rot/2]``, in float32; the rest pass through. ``x``'s dtype."""
    rot_dim = 2 * angles.shape[-1]
    cos = (jnp.cos(angles) * scale)[:, None, :]  # [T, 1, rot/2]
    sin = (jnp.sin(angles) * scale)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : rot_dim // 2], xf[..., rot_dim // 2 : rot_dim]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rot_dim < x.shape[-1]:
        rotated = jnp.concatenate([rotated, xf[..., rot_dim:]], axis=-1)
    return rotated.astype(x.dtype)


def _rotate_pairs(x: jax.Array, angles: jax.Array, scale: float) -> jax.Array:
    """Interleaved rope (``RopeSpec.interleaved``): features ``(2j, 2j + 1)`` of the
    first ``2 * angles.shape[-1]`` rotate as the complex number ``x[2j] + i x[2j + 1]``
    by ``angles[:, j]``, in float32; the rest pass through. ``x``'s dtype."""
    rot_dim = 2 * angles.shape[-1]
    cos = (jnp.cos(angles) * scale)[:, None, :]  # [T, 1, rot/2]
    sin = (jnp.sin(angles) * scale)[:, None, :]
    xf = x.astype(jnp.float32)
    pairs = xf[..., :rot_dim].reshape(*x.shape[:-1], rot_dim // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]  # [T, H, rot/2]
    rotated = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1)
    rotated = rotated.reshape(*x.shape[:-1], rot_dim)
    if rot_dim < x.shape[-1]:
        rotated = jnp.concatenate([rotated, xf[..., rot_dim:]], axis=-1)
    return rotated.astype(x.dtype)
