"""Weight-only quantization: the stored forms of a quantized weight and its matmul.

A `QuantScheme` says how each linear weight ``[..., out, in]`` is stored; the float
weight is always ``q * scale (+ offset)``, per output row or per group of
``group_size`` input columns:

- ``int8``: int8 values, ``|q| <= 127``, symmetric (``--quantization int8``,
  compressed-tensors int8, GGUF Q8_0 with groups of 32);
- ``fp8``: float8_e4m3fn values, ``|q| <= 448`` (``--quantization fp8``, vLLM's
  dynamic fp8; compressed-tensors fp8 checkpoints; block-scaled ``fp8`` checkpoints,
  DeepSeek-V3's, as groups of the block's width, each block's scale repeated on its
  rows: `loader.quantized`);
- ``int4``: unsigned 4-bit values 0..15, two per byte (column ``2k`` in the low
  nibble of byte ``k``, ``2k + 1`` in the high one), always with an ``offset`` per
  group or row (``w = q * scale + offset``), which holds symmetric
  (``offset = -8 * scale``) and zero-point forms (AWQ, GPTQ, compressed-tensors
  int4, GGUF Q4_0/Q4_1) alike;
- ``mxfp4`` (OCP microscaling FP4, gpt-oss's MoE experts): e2m1 4-bit floats
  (`E2M1`: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) packed two per byte as
  ``int4``, with one e8m0 exponent byte per group of 32 input columns:
  ``w = e2m1 * 2^(scale - 127)``. Only the MoE experts use it (`experts_only`): the
  attention and dense projections of such a model keep the model dtype.

The leaves beside ``<w>`` are ``<w>_scale`` and ``<w>_offset`` (``[..., out]`` per
row, ``[..., out, in / group_size]`` grouped; uint8 exponents for ``mxfp4``) and,
with ``act_order`` (GPTQ's ``desc_act``), ``<w>_g_idx [in]``: each input column's
group, in any order. int8 and fp8 groups may leave a partial last group (``in /
group_size`` rounded up), as block-scaled checkpoints do. Under tensor parallelism a
grouped int8/fp8 model whose groups would straddle two devices' input columns loads in
smaller groups (`split_group`, `regroup_scale`: the same weights, each scale repeated).

A weight may also be stored transposed, ``[..., in, out]`` (the layout a grouped
matmul takes: `layers.mlp`'s stacked experts): then the leaves of the weight's rank
(the values, grouped scales and offsets ``[..., in / group_size, out]``; packed bytes
``[..., in / 2, out]``, each byte still two consecutive input columns) have their last
two axes swapped (`transposed`), and per-row scales and offsets ``[..., out]`` and
``_g_idx`` are unchanged.

`quantized_linear` is the matmul (the weight converted inside it, a per-row scale
applied to the result); `dequantize` is its reference. `quantize` is the one
quantizer, for numpy (the loader) and jnp (tests) alike: pass the module as ``xp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_gmm.reference import dequantize_mxfp4 as dequantize_transposed
from pallas_kernels.quantized_matmul import quantized_matmul

METHODS = {
    "int8": (jnp.dtype(jnp.int8), 127.0),
    "fp8": (jnp.dtype(jnp.float8_e4m3fn), 448.0),
    "int4": (jnp.dtype(jnp.uint8), 15.0),
    "mxfp4": (jnp.dtype(jnp.uint8), 6.0),
}
"""Method -> (storage dtype, largest value it holds)."""

SUFFIXES = ("_scale", "_offset", "_g_idx")
"""What a quantized weight's sibling leaves append to its name."""

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (``mxfp4``): bit 3 the sign, bits 0-2 the magnitude."""

MXFP4_BLOCK = 32
"""Input columns per e8m0 exponent in ``mxfp4`` (16 packed bytes)."""

E8M0_BIAS = 127
"""An e8m0 exponent byte ``s`` scales its block by ``2^(s - 127)``."""


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How the linear weights of a model are stored (see the module docstring)."""

    method: str
    group_size: int = 0
    """Input columns per scale; 0: one scale per output row."""
    act_order: bool = False
    """Groups given per input column by ``<w>_g_idx`` (GPTQ ``desc_act``)."""
    dense_float: bool = False
    """Only the stacked MoE experts hold the scheme's leaves: every other projection
    keeps its weight in the model dtype, dequantized at load (block-scaled 8-bit MoE
    checkpoints on TPU: `loader.dense_float`)."""
    unquantized: tuple[str, ...] = ()
    """Modules kept in the model dtype (a checkpoint's ``ignored_layers`` or
    ``modules_to_not_convert``): Hugging Face module names, each matching the modules
    whose dotted name contains it as whole components (`quantizes`); a decoder layer's
    scheme holds them as the layer sees them (`layer_unquantized`)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}")
        if self.act_order and self.group_size <= 0:
            raise ValueError("act-order needs a group size")
        if self.method == "mxfp4" and (self.group_size != MXFP4_BLOCK or self.act_order):
            raise ValueError(f"mxfp4 has groups of {MXFP4_BLOCK} contiguous columns")
        if not isinstance(self.unquantized, tuple) or not all(
            isinstance(m, str) for m in self.unquantized
        ):
            raise ValueError(f"unquantized modules must be a tuple of names: {self.unquantized!r}")

    @property
    def has_offset(self) -> bool:
        return self.method == "int4"

    @property
    def packed(self) -> bool:
        """Two 4-bit values per byte along the input (``int4``, ``mxfp4``)."""
        return self.method in ("int4", "mxfp4")

    @property
    def experts_only(self) -> bool:
        """Only the stacked MoE experts are stored this way (``mxfp4``, as gpt-oss's
        checkpoints; `dense_float`); `layers.basic.Linear` keeps its weight in the model
        dtype."""
        return self.method == "mxfp4" or self.dense_float

    def quantizes(self, module: str) -> bool:
        """Whether the module of dotted name ``module`` (a decoder layer's modules
        named from the layer, ``mlp.experts``: `layer_unquantized`) is stored this
        way: not when an `unquantized` entry is a run of its components (``mlp.gate``
        in ``mlp.gate``, not in ``mlp.gate_proj``), or is ``""`` (a whole layer)."""
        parts = module.split(".")
        for entry in self.unquantized:
            want = entry.split(".") if entry else []
            if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
                return False
        return True

    def __str__(self) -> str:
        group = f", group {self.group_size}" if self.group_size else ""
        experts = ", experts only" if self.dense_float else ""
        return f"{self.method}{group}{', act-order' if self.act_order else ''}{experts}"


def layer_unquantized(entries: tuple[str, ...], index: int) -> tuple[str, ...]:
    """A checkpoint's unquantized modules (``ignored_layers``: Hugging Face names) as
    decoder layer ``index`` sees them (`LayerSpec.unquantized`): an entry under
    ``layers.<index>.`` (or ``layers.*.``) named from the layer, ``""`` for the whole
    layer; one under another layer dropped; one without a layer index (``mlp.gate``)
    kept, for every layer."""
    kept = []
    for entry in entries:
        parts = entry.split(".")
        at = next((i for i in range(len(parts) - 1) if parts[i] == "layers"), None)
        if at is None or not (parts[at + 1].isdigit() or parts[at + 1] == "*"):
            kept.append(entry)
        elif parts[at + 1] in ("*", str(index)):
            kept.append(".".join(parts[at + 2 :]))
    return tuple(dict.fromkeys(kept))


def leaf_specs(
    scheme: QuantScheme, shape: tuple[int, ...], axes: tuple, transpose: bool = False
) -> dict:
    """``{suffix: (shape, dtype, logical axes)}`` of the leaves storing a weight of
    float ``shape [..., out, in]`` with logical ``axes``; suffix "" is the weight.
    ``transpose``: the leaves stored ``[..., in, out]`` (module docstring)."""
    specs = _leaf_specs(scheme, shape, axes)
    if not transpose:
        return specs
    return {
        suffix: (_swap(s), dtype, _swap(a)) if len(s) == len(shape) else (s, dtype, a)
        for suffix, (s, dtype, a) in specs.items()
    }


def _swap(dims: tuple) -> tuple:
    return (*dims[:-2], dims[-1], dims[-2])


def transposed(leaves: dict) -> dict:
    """The leaves of a weight stored ``[..., in, out]`` from its ``[..., out, in]``
    leaves, or back (the same swap): those of the weight's rank have their last two
    axes swapped, the others (per-row scales, ``_g_idx``) are kept. numpy or jax."""
    rank = leaves[""].ndim
    return {s: v.swapaxes(-1, -2) if v.ndim == rank else v for s, v in leaves.items()}


def _leaf_specs(scheme: QuantScheme, shape: tuple[int, ...], axes: tuple) -> dict:
    *lead, out, inp = shape
    packed = inp // 2 if scheme.packed else inp
    specs = {"": ((*lead, out, packed), METHODS[scheme.method][0], axes)}
    if scheme.group_size:
        whole_groups = scheme.packed or scheme.has_offset or scheme.act_order
        if (whole_groups and inp % scheme.group_size) or (scheme.packed and inp % 2):
            raise ValueError(f"{inp} input columns do not split into groups of {scheme.group_size}")
        in_axis = None if scheme.act_order else axes[-1]
        side_dtype = jnp.uint8 if scheme.method == "mxfp4" else jnp.float32  # e8m0 exponents
        groups = -(-inp // scheme.group_size)  # int8/fp8: the last group may be partial
        side = ((*lead, out, groups), side_dtype, (*axes[:-1], in_axis))
    else:
        side = ((*lead, out), jnp.float32, axes[:-1])
    specs["_scale"] = side
    if scheme.has_offset:
        specs["_offset"] = side
    if scheme.act_order:
        specs["_g_idx"] = ((*lead, inp), jnp.int32, (*axes[:-2], axes[-1]))
    return specs


def split_group(group: int, inputs: int, shards: int) -> int:
    """The group size of a grouped weight of ``inputs`` columns in groups of ``group``
    whose input is split over ``shards`` devices: ``group`` when each device's share
    holds whole groups (or nothing is split), else the largest size dividing both
    ``group`` and the share (128-wide blocks over 576 columns a device: 64), so that
    each device holds whole groups of its own columns (`regroup_scale`). An input
    that does not split evenly is a ValueError."""
    if group <= 0 or inputs <= 0 or shards <= 0:
        raise ValueError(f"no groups of {group} in {inputs} inputs over {shards} devices")
    if inputs % shards:
        raise ValueError(f"{inputs} input columns do not split evenly over {shards} devices")
    share = inputs // shards
    return group if shards == 1 or share % group == 0 else math.gcd(group, share)


def regroup_scale(
    scale: Any, inputs: int, group: int, new_group: int, axis: int = -1, xp: Any = np
) -> Any:
    """int8/fp8 group scales ``[..., ceil(inputs / group)]`` along ``axis`` (-1; -2
    for a weight stored ``[..., in, out]``) as scales of groups of ``new_group``
    (dividing ``group``): each repeated ``group / new_group`` times, cut to
    ``ceil(inputs / new_group)``. Every column keeps its scale, so the dequantized
    weight is unchanged."""
    if new_group <= 0 or group % new_group:
        raise ValueError(f"groups of {group} do not split into groups of {new_group}")
    if scale.shape[axis] != -(-inputs // group):
        raise ValueError(
            f"{scale.shape[axis]} scales do not cover {inputs} inputs in groups of {group}"
        )
    repeated = xp.repeat(scale, group // new_group, axis=axis)
    kept = -(-inputs // new_group)
    return repeated[..., :kept] if axis == -1 else repeated[..., :kept, :]


def unpack_int4(packed: Any, xp: Any = jnp, axis: int = -1) -> Any:
    """``[..., n / 2]`` bytes -> ``[..., n]`` values 0..15 (low nibble first), along
    ``axis`` (-1, or -2 for a weight stored ``[..., in / 2, out]``)."""
    low, high = packed & 15, packed >> 4
    shape = list(packed.shape)
    shape[axis] *= 2
    return xp.stack([low, high], axis=axis % packed.ndim + 1).reshape(shape)


def pack_int4(values: Any, xp: Any = jnp) -> Any:
    """The inverse of `unpack_int4`: values 0..15 ``[..., n]`` -> bytes ``[..., n / 2]``."""
    v = xp.asarray(values).astype(xp.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(xp.uint8)


def dequantize(leaves: dict, scheme: QuantScheme, xp: Any = jnp, transpose: bool = False) -> Any:
    """The float32 weight ``[..., out, in]`` of the ``leaves`` (`leaf_specs` suffixes
    -> arrays): the reference of `quantized_linear`. ``transpose``: leaves stored
    ``[..., in, out]`` (`transposed`), and the weight comes out so, computed in that
    layout: no transpose of the result (a copy of the whole weight)."""
    axis = -2 if transpose else -1  # the input axis
    if scheme.method == "mxfp4":
        return dequantize_mxfp4(leaves[""], leaves["_scale"], xp, transpose)
    q = leaves[""]
    q = unpack_int4(q, xp, axis) if scheme.method == "int4" else q
    q, shape = q.astype(xp.float32), q.shape
    sides = [xp.asarray(leaves[s], dtype=xp.float32) for s in ("_scale", "_offset") if s in leaves]
    if not scheme.group_size:  # per row: [..., out]
        sides = [s[..., None, :] if transpose else s[..., None] for s in sides]
    elif scheme.act_order:  # each input's group, in any order: a gather
        g_idx = leaves["_g_idx"]
        groups = xp.broadcast_to(g_idx[..., None] if transpose else g_idx[..., None, :], q.shape)
        sides = [xp.take_along_axis(s, groups, axis=axis) for s in sides]
    elif shape[axis] % scheme.group_size:  # a partial last group: scales per input
        sides = [_per_input(s, scheme.group_size, shape[axis], axis, xp) for s in sides]
    else:  # contiguous groups: a broadcast over the group's inputs
        q = _grouped(q, scheme.group_size, transpose)
        sides = [s[..., None, :] if transpose else s[..., None] for s in sides]
    w = q * sides[0] + sides[1] if len(sides) > 1 else q * sides[0]
    return w.reshape(shape)


def _per_input(side: Any, size: int, inputs: int, axis: int, xp: Any) -> Any:
    """Group scales (``G`` along ``axis``, the input axis) repeated per input and cut
    to ``inputs``: the last group holds fewer than ``size``."""
    per_input = xp.repeat(side, size, axis=axis)
    return per_input[..., :inputs] if axis == -1 else per_input[..., :inputs, :]


def _grouped(q: Any, size: int, transpose: bool) -> Any:
    """``[..., out, in]`` as ``[..., out, G, size]``; ``[..., in, out]`` as ``[..., G,
    size, out]``."""
    if transpose:
        return q.reshape(*q.shape[:-2], -1, size, q.shape[-1])
    return q.reshape(*q.shape[:-1], -1, size)


def dequantize_mxfp4(packed: Any, scales: Any, xp: Any = jnp, transpose: bool = False) -> Any:
    """float32 ``[..., out, in]`` of e2m1 codes ``packed [..., out, in / 2]`` (uint8,
    column ``2k`` in the low nibble of byte ``k``) and e8m0 exponents ``scales [...,
    out, in / 32]`` (uint8): ``E2M1[code] * 2^(scale - 127)``. ``transpose``: both
    stored ``[..., in / 2, out]`` and ``[..., in / 32, out]``, the weight ``[..., in,
    out]``. ``xp``: numpy or jnp. The decoding is the grouped matmul's
    (`pallas_kernels.quantized_gmm.reference.dequantize_mxfp4`, transposed)."""
    if transpose:
        return dequantize_transposed(packed, scales, xp)
    swap = functools.partial(xp.swapaxes, axis1=-1, axis2=-2)
    return swap(dequantize_transposed(swap(xp.asarray(packed)), swap(xp.asarray(scales)), xp))


def quantize_mxfp4(weight: Any, xp: Any) -> dict:
    """The ``mxfp4`` leaves of a float ``weight [..., out, in]``: per block of 32
    columns the smallest exponent whose block fits e2m1's largest magnitude (6), each
    value rounded to the nearest e2m1 (for online updates of a MXFP4 model's experts)."""
    w = xp.asarray(weight, dtype=xp.float32)
    *lead, out, inp = w.shape
    g = w.reshape(*lead, out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xp.max(xp.abs(g), axis=-1)  # [..., out, G]
    exp = xp.ceil(xp.log2(xp.where(amax > 0, amax, 1.0) / 6.0))
    exp = xp.clip(xp.where(amax > 0, exp, -E8M0_BIAS), -E8M0_BIAS, E8M0_BIAS).astype(xp.int32)
    scaled = xp.ldexp(g, -exp[..., None])  # |scaled| <= 6
    magnitudes = xp.asarray(E2M1[:8], dtype=xp.float32)
    code = xp.argmin(xp.abs(xp.abs(scaled)[..., None] - magnitudes), axis=-1)
    code = xp.where(scaled < 0, code + 8, code).reshape(*lead, out, inp)
    return {"": pack_int4(code, xp), "_scale": (exp + E8M0_BIAS).astype(xp.uint8)}


def quantized_linear(x: jax.Array, leaves: dict, scheme: QuantScheme, dtype: Any) -> jax.Array:
    """``x [T, in] @ dequantize(leaves).T`` -> ``[T, out]`` in ``dtype``.

    Per-row scales commute with the dot (``x @ (q * s).T == (x @ q.T) * s``), so the
    dot runs on the weight converted to ``dtype`` and the scale multiplies the
    ``[T, out]`` result (`pallas_kernels.quantized_matmul`: on CUDA, a decode's few
    rows run its kernel, which widens the 8-bit weight in registers; XLA's dot
    elsewhere). Grouped or offset (int4) weights are dequantized to ``dtype`` inside
    the computation, as the dot's operand."""
    if scheme.group_size or scheme.has_offset:
        w = dequantize(leaves, scheme).astype(dtype)
        return jax.lax.dot_general(x.astype(dtype), w, (((x.ndim - 1,), (1,)), ((), ())))
    return quantized_matmul(x.astype(dtype), leaves[""], leaves["_scale"])


def quantize(weight: Any, scheme: QuantScheme | str, xp: Any) -> dict:
    """The `leaf_specs` leaves (suffix -> array) of a float ``weight [..., out, in]``.

    Symmetric per row or group for int8/fp8 (the largest magnitude mapped to the
    format's largest); min/max per group for int4; `quantize_mxfp4` for mxfp4. ``xp``
    is numpy or jax.numpy."""
    scheme = QuantScheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.method == "mxfp4":
        return quantize_mxfp4(weight, xp)
    dtype, largest = METHODS[scheme.method]
    w = xp.asarray(weight, dtype=xp.float32)
    *lead, out, inp = w.shape
    group = scheme.group_size or inp
    pad = -inp % group  # int8/fp8: a partial last group, padded with zeros here
    padded = xp.concatenate([w, xp.zeros((*lead, out, pad), xp.float32)], -1) if pad else w
    g = padded.reshape(*lead, out, -1, group)
    if scheme.method == "int4":
        low, high = xp.min(g, axis=-1), xp.max(g, axis=-1)
        scale = xp.where(high > low, (high - low) / largest, 1.0).astype(xp.float32)
        q = xp.clip(xp.round((g - low[..., None]) / scale[..., None]), 0, largest)
        q = pack_int4(q.reshape(*lead, out, inp), xp)
        leaves = {"": q, "_scale": scale, "_offset": low.astype(xp.float32)}
        if not scheme.group_size:
            leaves = {"": q, "_scale": scale[..., 0], "_offset": low[..., 0].astype(xp.float32)}
    else:
        amax = xp.max(xp.abs(g), axis=-1)
        scale = xp.where(amax > 0, amax / largest, 1.0).astype(xp.float32)
        scaled = xp.clip(g / scale[..., None], -largest, largest)
        if scheme.method == "int8":
            scaled = xp.round(scaled)
        q = scaled.reshape(*lead, out, inp + pad)[..., :inp].astype(dtype)
        leaves = {"": q, "_scale": scale if scheme.group_size else scale[..., 0]}
    if scheme.act_order:  # contiguous groups, spelled out per column
        leaves["_g_idx"] = xp.broadcast_to(xp.arange(inp) // group, (*lead, inp)).astype(xp.int32)
    return leaves
