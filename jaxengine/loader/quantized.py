"""Quantized safetensors checkpoints: GPTQ, AWQ and compressed-tensors.

`checkpoint_quantization(hf_config, requested)` reads ``quantization_config`` from
``config.json`` as vLLM does and returns a `CheckpointFormat`: the `QuantScheme` the
model is built with and the tensor parts that store one linear weight.
`canonical_tensors` then turns each weight's parts into the scheme's leaves
(`layers.quant`: ``weight``, ``weight_scale``, ``weight_offset``, ``weight_g_idx``),
repacked on the host once, so the device keeps the weight packed:

- GPTQ (4 bits): ``qweight`` int32 ``[in / 8, out]`` (eight values per word along the
  input, value ``i`` in bits ``4i``), ``qzeros`` int32 ``[groups, out / 8]`` packed the
  same way along the output, ``scales [groups, out]``, ``g_idx [in]``;
  ``w = (q - z) * s`` with ``z`` the stored zero plus one (the original "gptq" format;
  ``gptq_v2`` stores ``z`` itself). ``desc_act`` keeps ``g_idx`` (act-order).
- AWQ (4 bits, GEMM): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros``
  ``[groups, out / 8]`` packed along the output in AWQ's order (output ``8k + j`` in
  nibble ``[0, 4, 1, 5, 2, 6, 3, 7][j]``), ``scales [groups, out]``; ``w = (q - z) * s``.
- compressed-tensors: ``pack-quantized`` int4 (``weight_packed`` int32
  ``[out, in / 8]``, value ``i`` in bits ``4i``, stored as signed value + 8;
  ``weight_scale [out, groups]``; ``weight_zero_point`` packed along the output when
  asymmetric; ``weight_g_idx`` with group act-order), ``int-quantized`` int8 and
  ``float-quantized`` fp8 (``weight`` and ``weight_scale`` per channel or tensor).
  Activation quantization (W8A8) is not applied: activations stay in the model
  dtype, as vLLM runs such checkpoints on hardware without int8/fp8 matmuls.
- MXFP4 (gpt-oss): the MoE experts' ``<w>_blocks`` and ``<w>_scales`` (`loader.mxfp4`),
  kept as the ``mxfp4`` scheme's packed bytes and exponents; the rest is float.
- block fp8 (``quant_method: fp8``, DeepSeek-V3 and its kin): e4m3 ``weight`` and
  ``weight_scale_inv`` per ``weight_block_size`` block, kept as ``fp8`` groups
  (`_block_fp8`).

Grouped int8/fp8 weights whose groups a tensor-parallel split would cut (DeepSeek-V3's
128-wide blocks over 576 ``down_proj`` columns a device at TP 32) load in the smaller
groups `tensor_parallel_group` picks for the whole model, the checkpoint's scales
repeated to fit (`regrouped_tensors`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.mxfp4 import mxfp4_tensors
from jaxengine.models.layers.mlp import checkpoint_transposed
from jaxengine.models.layers.quant import (
    MXFP4_BLOCK,
    QuantScheme,
    pack_int4,
    regroup_scale,
    split_group,
)

logger = logging.getLogger(__name__)

CHECKPOINT_METHODS = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "mxfp4": "mxfp4",
    "fp8": "fp8",
}
"""``--quantization`` (and ``quant_method``) values of quantized checkpoints -> format."""

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""AWQ's nibble of output ``8k + j`` within a packed word: ``AWQ_ORDER[j]``."""


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """How a quantized checkpoint stores its linear weights."""

    method: str  # "gptq" | "awq" | "compressed-tensors" | "mxfp4" | "fp8"
    scheme: QuantScheme
    required: tuple[str, ...]  # tensor suffixes that make up one weight
    dropped: tuple[str, ...]  # tensor suffixes with nothing to give (this scheme)
    convert: Callable[[dict], dict]  # parts by suffix -> leaves by suffix ("", "_scale"...)
    canonical: Callable | None = None
    """``(tensors, source) -> tensors``: the format's own pass in place of
    `canonical_tensors`' parts -> leaves (MXFP4: `loader.mxfp4.mxfp4_tensors`)."""


def quantization_config(hf_config: Any) -> dict | None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return quant


def checkpoint_quantization(hf_config: Any, requested: str | None) -> CheckpointFormat | None:
    """The checkpoint's quantized format, None for a float checkpoint.

    Refuses a ``--quantization`` that differs from the checkpoint's (vLLM's check) and
    a method, bit width or layout that is not supported, naming it."""
    quant = quantization_config(hf_config)
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise NotImplementedError(
            f"--quantization {method or '(unnamed)'} is not supported yet (the checkpoint's "
            f"quantization_config); supported: {', '.join(sorted(set(CHECKPOINT_METHODS)))}"
        )
    if requested is not None and CHECKPOINT_METHODS.get(requested) != CHECKPOINT_METHODS[method]:
        raise ValueError(
            f"Quantization method specified in the model config ({method}) does not match "
            f"the quantization method specified in the `quantization` argument ({requested})."
        )
    build = {
        "gptq": _gptq,
        "awq": _awq,
        "compressed-tensors": _compressed_tensors,
        "mxfp4": _mxfp4,
        "fp8": _block_fp8,
    }
    return build[CHECKPOINT_METHODS[method]](quant)


def _refuse(method: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{method} checkpoints with {what} are not supported")


def _group(quant: dict, method: str) -> int:
    group = int(quant.get("group_size", -1) or -1)
    if group != -1 and group <= 0:
        raise _refuse(method, f"group_size {group}")
    return max(group, 0)


def _gptq(quant: dict) -> CheckpointFormat:
    if int(quant.get("bits", 4)) != 4:
        raise _refuse("GPTQ", f"{quant.get('bits')}-bit weights")
    if quant.get("lm_head"):
        raise _refuse("GPTQ", "a quantized lm_head")
    group = _group(quant, "GPTQ")
    act_order = bool(quant.get("desc_act")) and group > 0
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("GPTQ", f"checkpoint_format {fmt!r}")
    zero_shift = 1 if fmt == "gptq" else 0

    def convert(parts: dict) -> dict:
        q = _unpack_words(parts["qweight"], axis=0).T  # [out, in]
        zeros = _unpack_words(parts["qzeros"], axis=1)[:, : q.shape[0]] + zero_shift
        leaves = _int4_leaves(q, parts["scales"].T, zeros.T)
        if act_order:
            leaves["_g_idx"] = np.asarray(parts["g_idx"], np.int32)
        return leaves

    scheme = QuantScheme("int4", group, act_order)
    parts = ("qweight", "qzeros", "scales")
    if act_order:
        return CheckpointFormat("gptq", scheme, (*parts, "g_idx"), (), convert)
    return CheckpointFormat("gptq", scheme, parts, ("g_idx",), convert)


def _awq(quant: dict) -> CheckpointFormat:
    if int(quant.get("bits", quant.get("w_bit", 4))) != 4:
        raise _refuse("AWQ", f"{quant.get('bits')}-bit weights")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("AWQ", f"version {version!r} (only 'gemm')")
    if not quant.get("zero_point", True):
        raise _refuse("AWQ", "zero_point false")
    group = _group(quant, "AWQ")

    def convert(parts: dict) -> dict:
        q = _unpack_words(parts["qweight"], axis=1, order=AWQ_ORDER)  # [in, out]
        zeros = _unpack_words(parts["qzeros"], axis=1, order=AWQ_ORDER)
        return _int4_leaves(q.T, parts["scales"].T, zeros.T)

    scheme = QuantScheme("int4", group)
    return CheckpointFormat("awq", scheme, ("qweight", "qzeros", "scales"), (), convert)


def _mxfp4(quant: dict) -> CheckpointFormat:
    """gpt-oss's MXFP4 experts: the family maps each ``<w>_blocks``/``<w>_scales``
    pair (checked by `loader.mxfp4`) onto its ``mxfp4`` leaves as they are."""
    del quant  # modules_to_not_convert: those modules are simply stored in float

    def convert(parts: dict) -> dict:
        raise AssertionError("mxfp4 tensors are paired by loader.mxfp4, not converted")

    scheme = QuantScheme("mxfp4", MXFP4_BLOCK)
    return CheckpointFormat("mxfp4", scheme, (), (), convert, canonical=mxfp4_tensors)


def _block_fp8(quant: dict) -> CheckpointFormat:
    """Block-scaled fp8 (``quant_method: fp8`` with ``weight_block_size [n, k]``:
    DeepSeek-V3, Kimi K2, GLM-4.5-FP8, Qwen3-FP8): e4m3 ``weight [out, in]`` and
    float32 ``weight_scale_inv [ceil(out / n), ceil(in / k)]``, the weight being
    ``weight * weight_scale_inv`` over each ``n x k`` block. Loaded as the ``fp8``
    scheme with groups of ``k`` inputs, each block's scale repeated on its ``n`` rows
    (``[out, ceil(in / k)]``: a float32 per ``k`` bytes of weight). Activations stay in
    the model dtype (``activation_scheme`` dynamic; static input scales are refused).
    ``ignored_layers`` (or ``modules_to_not_convert``) stay in the model dtype."""
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse("fp8", f"quantization_config.fmt {fmt!r} (only 'e4m3')")
    activations = str(quant.get("activation_scheme", "dynamic")).lower()
    if activations != "dynamic":
        raise _refuse(
            "fp8", f"quantization_config.activation_scheme {activations!r} (only 'dynamic')"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise _refuse("fp8", "per-tensor scales (no quantization_config.weight_block_size)")
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise _refuse("fp8", f"quantization_config.weight_block_size {block!r}")
    rows, cols = block
    unquantized = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ()

    def convert(parts: dict) -> dict:
        weight, scale_inv = np.asarray(parts["weight"]), np.asarray(parts["weight_scale_inv"])
        if weight.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(f"weight stored as {weight.dtype}, not float8_e4m3fn")
        *lead, out, inp = weight.shape
        blocks = (*lead, -(-out // rows), -(-inp // cols))
        if scale_inv.shape != blocks:
            raise ValueError(
                f"weight_scale_inv has shape {scale_inv.shape}; a weight of shape "
                f"{weight.shape} in blocks of {rows} x {cols} needs {blocks}"
            )
        scale = np.repeat(scale_inv.astype(np.float32), rows, axis=-2)[..., :out, :]
        return {"": weight, "_scale": scale}

    scheme = QuantScheme("fp8", cols, unquantized=tuple(unquantized))
    return CheckpointFormat("fp8", scheme, ("weight", "weight_scale_inv"), (), convert)


def _unpack_words(words: np.ndarray, axis: int, order: Iterable[int] = range(8)) -> np.ndarray:
    """int32 words of eight 4-bit values -> the values (0..15) along ``axis``, value
    ``j`` of each word taken from nibble ``order[j]``."""
    w = np.asarray(words).astype(np.uint32)
    nibbles = np.stack([(w >> (4 * i)) & 15 for i in order], axis=axis + 1)
    shape = list(w.shape)
    shape[axis] *= 8
    return nibbles.reshape(shape).astype(np.int32)


def _int4_leaves(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> dict:
    """Leaves of ``w = (q - zero) * scale``: q ``[out, in]`` (0..15), scales and
    zeros ``[out, groups]`` (one group: per row)."""
    scale = np.asarray(scales, np.float32)
    offset = -np.asarray(zeros, np.float32) * scale
    if scale.shape[-1] == 1:
        scale, offset = scale[:, 0], offset[:, 0]
    return {"": pack_int4(q, np), "_scale": scale, "_offset": offset}


def _compressed_tensors(quant: dict) -> CheckpointFormat:
    weights = _ct_weights(quant)
    bits, kind = int(weights.get("num_bits", 8)), weights.get("type", "int")
    strategy = weights.get("strategy", "channel")
    if strategy not in ("channel", "group", "tensor"):
        raise _refuse("compressed-tensors", f"strategy {strategy!r}")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    act_order = weights.get("actorder") == "group"
    method = {(4, "int"): "int4", (8, "int"): "int8", (8, "float"): "fp8"}.get((bits, kind))
    if method is None or (method != "int4" and not weights.get("symmetric", True)):
        symmetric = "symmetric" if weights.get("symmetric", True) else "asymmetric"
        raise _refuse("compressed-tensors", f"{symmetric} {bits}-bit {kind} weights")
    if quant.get("config_groups") and any(
        (g.get("input_activations") or {}).get("num_bits") for g in quant["config_groups"].values()
    ):
        logger.info("compressed-tensors: activations stay in the model dtype (weight-only)")
    scheme = QuantScheme(method, group, act_order and group > 0)
    if method == "int4":
        required = ("weight_packed", "weight_scale")
        required += () if weights.get("symmetric", True) else ("weight_zero_point",)
        required += ("weight_g_idx",) if scheme.act_order else ()
        dropped = ("weight_shape",) + (() if scheme.act_order else ("weight_g_idx",))
        return CheckpointFormat("compressed-tensors", scheme, required, dropped, _ct_int4(scheme))
    dropped = ("weight_zero_point", "input_scale", "input_zero_point")
    return CheckpointFormat(
        "compressed-tensors", scheme, ("weight", "weight_scale"), dropped, _ct_8bit(method)
    )


def _ct_weights(quant: dict) -> dict:
    """The one weight scheme of the checkpoint's ``config_groups``."""
    groups = quant.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if g.get("weights")]
    if not schemes:
        raise _refuse("compressed-tensors", "no weight quantization in config_groups")
    if any(s != schemes[0] for s in schemes[1:]):
        raise _refuse("compressed-tensors", "different weight schemes per layer group")
    return schemes[0]


def _ct_int4(scheme: QuantScheme) -> Callable[[dict], dict]:
    def convert(parts: dict) -> dict:
        q = _unpack_words(parts["weight_packed"], axis=1)  # [out, in]
        scale = np.asarray(parts["weight_scale"], np.float32)
        zero = parts.get("weight_zero_point")
        if zero is None:  # symmetric: signed values stored + 8
            zeros = np.full(scale.shape, 8, np.int32)
        else:  # signed zero points, packed like the values along the output
            zeros = _unpack_words(zero, axis=0)[: q.shape[0]]
        leaves = _int4_leaves(q, scale, zeros)
        if scheme.act_order:
            leaves["_g_idx"] = np.asarray(parts["weight_g_idx"], np.int32)
        return leaves

    return convert


def _ct_8bit(method: str) -> Callable[[dict], dict]:
    stored = np.int8 if method == "int8" else ml_dtypes.float8_e4m3fn

    def convert(parts: dict) -> dict:
        weight = np.asarray(parts["weight"])
        if weight.dtype != stored:
            raise CheckpointError(f"{method} weights stored as {weight.dtype}")
        zero = parts.get("weight_zero_point")
        if zero is not None and np.any(np.asarray(zero) != 0):
            raise _refuse("compressed-tensors", "asymmetric 8-bit weights")
        scale = np.asarray(parts["weight_scale"], np.float32)
        if scale.size == 1:  # per tensor: the same scale on every row
            scale = np.full(weight.shape[:1], scale.reshape(()), np.float32)
        elif scale.shape[-1] == 1:  # per channel [out, 1]
            scale = scale[:, 0]
        return {"": weight, "_scale": scale}

    return convert


def canonical_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], fmt: CheckpointFormat, source: str
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each quantized weight's parts replaced by its
    leaves (``<module>.weight``, ``<module>.weight_scale``...), emitted once all of
    its parts have been read; other tensors pass through (a float ``weight`` too, for
    formats whose quantized weight is also named ``weight``). A weight missing a part
    is a `CheckpointError` naming it. A format with its own pass (``canonical``) runs
    that instead."""
    if fmt.canonical is not None:
        yield from fmt.canonical(tensors, source)
        return
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        name = _KV_SCALE.sub(r".\1_scale", name)
        module, _, suffix = name.rpartition(".")
        if suffix in fmt.dropped:
            continue
        if suffix not in fmt.required or (suffix == "weight" and _is_float(array)):
            yield name, array
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = array
        if len(parts) == len(fmt.required):
            yield from _emit(module, pending.pop(module), fmt, source)
    for module, parts in pending.items():
        missing = next(s for s in fmt.required if s not in parts)
        raise CheckpointError(f"{source}: {module}.{missing} missing ({fmt.method} checkpoint)")


_KV_SCALE = re.compile(r"\.([kv])_proj\.output_scale$")
"""compressed-tensors' older name of the KV cache scales: ``self_attn.k_proj.output_scale``
for ``self_attn.k_scale``."""


def _is_float(array: np.ndarray) -> bool:
    """A float tensor (bfloat16 too), not a quantized one (int8, float8)."""
    dtype = np.dtype(array.dtype)
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def _emit(module: str, parts: dict, fmt: CheckpointFormat, source: str):
    try:
        leaves = fmt.convert(parts)
    except (ValueError, IndexError, KeyError) as e:
        raise CheckpointError(
            f"{source}: {module}: cannot read its {fmt.method} weight: {e}"
        ) from e
    for suffix, leaf in leaves.items():
        yield f"{module}.weight{suffix}", leaf


def tensor_parallel_group(
    scheme: QuantScheme | None, config: Any, logical: Any, abstract: Any, placement: Callable
) -> int:
    """The group size a model of grouped int8/fp8 ``scheme`` loads with under
    ``placement`` (`load_model`'s: ``(config, logical axes, abstract params) ->
    shardings``): the scheme's own, or the largest size that divides it and each
    device's share of the input columns of every weight whose input axis is split
    (`quant.split_group`), so that every device holds whole groups. One size for the
    model: the layers declare every scale leaf's shape from the one scheme. Other
    schemes keep theirs. An input that does not split evenly is the placement's error
    (or this one), naming the weight and the sizes."""
    if scheme is None or not scheme.group_size:
        return 0
    if scheme.method not in ("int8", "fp8") or scheme.act_order:
        return scheme.group_size
    flat = dict(_flat(abstract))
    weights = {  # the grouped weights: scales of the weight's rank
        (*p[:-1], p[-1].removesuffix("_scale")): s
        for p, s in flat.items()
        if p[-1].endswith("_scale")
    }
    weights = {p: w for p, w in flat.items() if p in weights and weights[p].ndim == w.ndim}
    unsplit = {(*p[:-1], p[-1] + "_scale") for p in weights}  # placed whole in the probe
    probe = jax.tree_util.tree_map_with_path(
        lambda path, spec: PartitionSpec() if _keys(path) in unsplit else spec,
        logical,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    shardings = dict(_flat(placement(config, probe, abstract)))
    group = scheme.group_size
    for path, weight in weights.items():
        dim = weight.ndim - (2 if checkpoint_transposed(path[-1], weight.ndim) else 1)
        shards = _shards(shardings[path], dim)
        try:
            group = math.gcd(group, split_group(scheme.group_size, weight.shape[dim], shards))
        except ValueError as e:
            raise ValueError(f"parameter {'/'.join(path)}: {e}") from e
    if group != scheme.group_size:
        logger.info("%s groups of %d split over tensor-parallel devices as groups of %d",
                    scheme.method, scheme.group_size, group)  # fmt: skip
    return group


def _keys(path: tuple) -> tuple[str, ...]:
    return tuple(getattr(k, "key", str(k)) for k in path)


def _flat(tree: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ((_keys(path), leaf) for path, leaf in leaves)


def _shards(sharding: Any, dim: int) -> int:
    """How many devices split axis ``dim`` of a leaf placed by ``sharding``."""
    spec = tuple(sharding.spec)
    axes = spec[dim] if dim < len(spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(sharding.mesh.shape[a] for a in axes)


def regrouped_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], group: int, new_group: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical tensors (`canonical_tensors`, or GGUF's packed leaves) with the
    grouped scales ``<module>.weight_scale [..., out, groups]`` of each int8/fp8
    ``<module>.weight [..., out, in]`` (as the checkpoint orients them) regrouped from
    ``group`` to ``new_group`` columns (`quant.regroup_scale`: the same weight); a
    scale seen before its weight waits for it (its input count). The rest as they
    come; a scale whose weight never comes goes on as it is, for the loader to name."""
    weights: dict[str, tuple[int, ...]] = {}  # module -> its quantized weight's shape
    waiting: dict[str, np.ndarray] = {}
    for name, array in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and np.dtype(array.dtype).itemsize == 1:
            weights[module] = tuple(array.shape)
            yield name, array
            if module in waiting:
                yield f"{module}.weight_scale", _fit(waiting.pop(module), weights[module],
                                                     group, new_group)  # fmt: skip
        elif leaf == "weight_scale" and module not in weights:
            waiting[module] = array
        elif leaf == "weight_scale":
            yield name, _fit(array, weights[module], group, new_group)
        else:
            yield name, array
    for module, array in waiting.items():
        yield f"{module}.weight_scale", array


def _fit(scale: np.ndarray, weight: tuple[int, ...], group: int, new_group: int) -> np.ndarray:
    """A weight's scales in groups of ``new_group``: grouped ones (of the weight's
    rank) regrouped, per-row ones as they are."""
    if np.ndim(scale) != len(weight):
        return scale
    return regroup_scale(np.asarray(scale, np.float32), weight[-1], group, new_group)
