"""GGUF projections kept packed: Q8_0 as grouped int8, Q4_0 and Q4_1 as grouped int4.

GGML's blocks hold 32 consecutive values of a row with their own float16 scale:

- Q8_0, 34 bytes: ``d``, then 32 int8 values; ``w = d * q``;
- Q4_0, 18 bytes: ``d``, then 16 bytes whose low nibbles are values 0..15 and high
  nibbles values 16..31; ``w = d * (q - 8)``;
- Q4_1, 20 bytes: ``d``, ``m``, then the nibbles as Q4_0; ``w = d * q + m``.

These are `layers.quant` schemes with groups of 32 (int4's offset is ``-8 d`` or
``m``), so a file whose projections are all Q8_0, or all Q4_0/Q4_1, loads without
dequantizing: `packed_scheme` says which, `packed_leaves` repacks one tensor's blocks
into the scheme's leaves (one byte per two int4 values, as stored). Any other type
among the projections (K-quants, F16) keeps the whole file on the dequantizing path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import gguf
import numpy as np

from jaxengine.models.layers.quant import pack_int4

_Q = gguf.GGMLQuantizationType
BLOCK = 32
PACKED_METHODS = {_Q.Q8_0: "int8", _Q.Q4_0: "int4", _Q.Q4_1: "int4"}
"""GGML types kept packed -> the `layers.quant` method they load as."""

_PROJECTION = re.compile(r"\.(\w+_proj)\.weight$")


def is_projection(hf_name: str) -> bool:
    """A linear projection of attention or an MLP (stacked experts included)."""
    return _PROJECTION.search(hf_name) is not None


def packed_scheme(projections: Iterable[tuple[str, Any]]) -> tuple[str | None, str]:
    """``(method, why)``: the method every projection (``(name, ggml type)``) loads
    packed as, or None with the reason it cannot."""
    types = {name: ggml_type for name, ggml_type in projections}
    methods = {PACKED_METHODS.get(t) for t in types.values()}
    if not types:
        return None, "no projections"
    if None in methods:
        other = sorted({t.name for t in types.values() if t not in PACKED_METHODS})
        return None, f"projections of type {', '.join(other)}"
    if len(methods) > 1:
        return None, "projections of both 8-bit and 4-bit types"
    return methods.pop(), ""


def packed_leaves(raw: np.ndarray, ggml_type: Any, shape: tuple[int, ...]) -> dict:
    """The `layers.quant` leaves (suffix -> array) of one tensor's blocks ``raw``
    (bytes) of float ``shape [..., out, in]``: values ``[..., out, in]`` (int8) or
    ``[..., out, in / 2]`` (int4), scales and offsets ``[..., out, in / 32]``."""
    *lead, inp = shape
    size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks = np.asarray(raw, np.uint8).reshape(*lead, inp // BLOCK, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == _Q.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(*lead, inp)
        return {"": q, "_scale": d}
    start = 4 if ggml_type == _Q.Q4_1 else 2
    nibbles = blocks[..., start:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(*lead, inp)
    if ggml_type == _Q.Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8 * d
    return {"": pack_int4(q, np), "_scale": d, "_offset": offset}
