"""GGUF checkpoints: header parsing and tensors under their Hugging Face names.

`iter_gguf` yields ``(hf_name, float32 array)`` pairs in Hugging Face layout, one
tensor at a time, so the caller can move each to the device and drop it. Tensors are
dequantized by the ``gguf`` package (``gguf.quants.dequantize``: F32, F16, BF16,
Q4_0/1, Q5_0/1, Q8_0, the K-quants, IQ types). Names are mapped with ``gguf``'s own
tensor name maps, inverted over the Hugging Face module names of the supported
architectures. What the result must equal, tensor by tensor, is what ``transformers``
loads from the same file; it undoes two llama.cpp conversions, as transformers does:

- ``llama`` (and Mistral, which llama.cpp files as ``llama``): the rows of Q and K
  were permuted per head for llama.cpp's RoPE layout; the inverse is applied here.
- ``gemma``, ``gemma2``, ``gemma3``: RMSNorm weights were stored as ``1 + w`` (the
  scale the norm applies); transformers' Gemma norm adds the 1 itself, so 1 is taken
  off every ``*norm.weight``.

MoE experts (``qwen3moe``), stored stacked as ``blk.N.ffn_{gate,up,down}_exps``, are
yielded per expert under the checkpoint names of Hugging Face safetensors files,
``model.layers.N.mlp.experts.E.gate_proj.weight``, so one naming serves both formats.
A file without ``output.weight`` has tied embeddings: no ``lm_head.weight`` is made up.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds numpy
views of every metadata item and takes seconds on a 262k-token vocabulary; tensor
data is read through one memory map of the file.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.gguf_packed import is_projection, packed_leaves, packed_scheme

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3")
_PERMUTED_QK_ARCHS = ("llama",)
_NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")
# Tensors llama.cpp adds that are no Hugging Face parameter (rope scaling factors).
_NOT_PARAMETERS = re.compile(r"^(rope_freqs|rope_factors_(long|short))\.weight$")

# Hugging Face module names; `gguf`'s map for an architecture tells which exist there.
_HF_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_HF_BLOCK = tuple(
    f"model.layers.{{bid}}.{m}"
    for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm",
        "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
    )
)  # fmt: skip
_STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\w+_proj)$")

_T = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I",
    _T.INT32: "<i", _T.FLOAT32: "<f", _T.BOOL: "<?", _T.UINT64: "<Q", _T.INT64: "<q",
    _T.FLOAT64: "<d",
}  # fmt: skip
_PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the header. ``shape`` is numpy order (GGUF's reversed)."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the data in the file."""
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed GGUF header: metadata key/values and the tensor table."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Little-endian reads from a buffer; running past its end raises CheckpointError."""

    def __init__(self, buf: Any, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise CheckpointError(f"{self.path}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF header")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _T.STRING:
            return self.string()
        if vtype == _T.ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise CheckpointError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.unpack(fmt)

    def array(self) -> list:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is None:  # strings or nested arrays: one by one
            return [self.value(etype) for _ in range(count)]
        size = struct.calcsize(fmt) * count
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF header")
        values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos).tolist()
        self.pos += size
        return values


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parses a GGUF file's header; checks every tensor's data lies inside the file.

    Raises `CheckpointError` naming the file when it is missing, not GGUF, of an
    unsupported version, truncated, or lists a tensor of unknown type.
    """
    path = Path(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_header(memoryview(mm), path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such GGUF file") from None
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: cannot read GGUF file: {e}") from e


def _parse_header(buf: memoryview, path: Path) -> GGUFHeader:
    try:
        cur = _Cursor(buf, path)
        if len(buf) < 8 or cur.unpack("<I") != gguf.GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            raw_infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // align) * align
        tensors = tuple(_tensor_info(path, data_start, len(buf), *raw) for raw in raw_infos)
    finally:
        buf.release()
    return GGUFHeader(path, version, metadata, tensors)


def _tensor_info(
    path: Path, data_start: int, file_size: int, name: str, dims: list, type_id: int, off: int
) -> GGUFTensorInfo:
    try:
        ggml_type = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown GGML type {type_id}") from None
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
    offset = data_start + off
    if offset + n_bytes > file_size:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} needs bytes up to {offset + n_bytes}, "
            f"the file has {file_size}"
        )
    return GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), offset, n_bytes)


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata key/values of a GGUF file (vocabulary arrays included)."""
    return read_gguf_header(path).metadata


def dequantize_tensor(buf: Any, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's values as a new float32 array of shape ``info.shape``."""
    dtype = _PLAIN_DTYPES.get(info.ggml_type)
    if dtype is not None:
        raw = np.frombuffer(buf, dtype, int(np.prod(info.shape)), info.offset)
        return raw.reshape(info.shape).astype(np.float32)  # astype copies out of the map
    shape = gguf.quant_shape_to_byte_shape(info.shape, info.ggml_type)
    raw = np.frombuffer(buf, np.uint8, info.n_bytes, info.offset).reshape(shape)
    try:
        out = gguf.quants.dequantize(raw, info.ggml_type)
    except NotImplementedError as e:
        raise CheckpointError(f"tensor {info.name!r}: {e}") from e
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def hf_name_map(arch: str, n_blocks: int) -> dict[str, str]:
    """GGUF tensor base name (no ``.weight``/``.bias``) -> Hugging Face module name."""
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch not in SUPPORTED_GGUF_ARCHS or arch_id is None:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    name_map = gguf.get_tensor_name_map(arch_id, n_blocks)
    out: dict[str, str] = {}
    templates = [*_HF_GLOBAL, *(t.format(bid=b) for b in range(n_blocks) for t in _HF_BLOCK)]
    for hf in templates:
        gguf_name = name_map.get_name(hf)
        if gguf_name is not None:
            out.setdefault(gguf_name, hf)
    return out


def iter_gguf(path: str | os.PathLike, packed: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(hf_name, array)`` for every tensor of a GGUF file, lazily.

    Arrays are float32, in Hugging Face layout (``[out, in]`` for linear weights),
    owned (not views of the file) and equal to what ``transformers`` loads from the
    same file. Stacked MoE experts come out per expert (see the module docstring).
    With ``packed`` (`gguf_packed_method` said yes) each projection comes out as its
    `gguf_packed` leaves instead (``...q_proj.weight``, ``...q_proj.weight_scale``...).
    Raises `CheckpointError` naming the file for a corrupt or truncated file, an
    unsupported architecture, or a tensor with no Hugging Face name.
    """
    header, names = _named_header(path)
    md, arch = header.metadata, header.architecture
    with header.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if len(mm) < max((t.offset + t.n_bytes for t in header.tensors), default=0):
            raise CheckpointError(f"{header.path}: file was truncated while reading")
        for info in header.tensors:
            hf = _hf_name(info.name, names)
            if hf is None:
                logger.debug("%s: skipping %s (not a model parameter)", header.path, info.name)
                continue
            if packed and is_projection(hf):
                leaves = _packed_tensor(mm, info)
            else:
                leaves = {"": dequantize_tensor(mm, info)}
            for suffix, leaf in leaves.items():
                yield from _per_expert(hf + suffix, _to_hf_layout(leaf, info.name, arch, md))


def _packed_tensor(buf: Any, info: GGUFTensorInfo) -> dict:
    """`gguf_packed.packed_leaves` of one tensor, copied out of the file's map."""
    raw = np.frombuffer(buf, np.uint8, info.n_bytes, info.offset)
    return packed_leaves(raw, info.ggml_type, info.shape)


def gguf_packed_method(path: str | os.PathLike) -> tuple[str | None, str]:
    """``(method, why)``: how the file's projections load packed (`gguf_packed`), or
    None and the reason they cannot."""
    header, names = _named_header(path)
    projections = [(hf, t.ggml_type) for t in header.tensors if (hf := _hf_name(t.name, names))]
    return packed_scheme((hf, t) for hf, t in projections if is_projection(hf))


def _named_header(path: str | os.PathLike) -> tuple[GGUFHeader, dict[str, str]]:
    """The header and its GGUF -> Hugging Face module names; every tensor must have one."""
    header = read_gguf_header(path)
    arch = header.architecture
    names = hf_name_map(arch, int(header.metadata.get(f"{arch}.block_count", 0)))
    unknown = [t.name for t in header.tensors if _hf_name(t.name, names) is None]
    unknown = [n for n in unknown if not _NOT_PARAMETERS.match(n)]
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise CheckpointError(f"{header.path}: tensors with no Hugging Face name: {shown}")
    return header, names


def _per_expert(hf: str, weights: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """One tensor, or a stacked ``[E, ...]`` experts tensor as E tensors."""
    module, suffix = hf.rsplit(".", 1)
    experts = _STACKED_EXPERTS.match(module)
    if experts is None:
        yield hf, weights
        return
    prefix, proj = experts.groups()
    for e in range(weights.shape[0]):
        yield f"{prefix}.{e}.{proj}.{suffix}", weights[e]


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    base, dot, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias") or base not in names:
        return None
    return f"{names[base]}{dot}{suffix}"


def _to_hf_layout(w: np.ndarray, gguf_name: str, arch: str, md: dict) -> np.ndarray:
    """Undoes llama.cpp's conversion-time changes to one tensor (see module docstring)."""
    if arch in _NORM_PLUS_ONE_ARCHS and gguf_name.endswith("norm.weight"):
        return w - 1
    if arch in _PERMUTED_QK_ARCHS and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name):
        bid = int(gguf_name.split(".")[1])
        n_head = _per_layer(md[f"{arch}.attention.head_count"], bid)
        if ".attn_k." in gguf_name:
            n_head = _per_layer(md.get(f"{arch}.attention.head_count_kv", n_head), bid)
        return _unpermute_rows(w, n_head)
    return w


def _per_layer(value: int | list, bid: int) -> int:
    return int(value[bid] if isinstance(value, list) else value)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: per head, rows (2, d/2) interleaved -> halves.

    llama.cpp reorders each head's rows from ``[x0..x(d/2-1), y0..y(d/2-1)]`` (rotary
    halves, Hugging Face) to ``[x0, y0, x1, y1, ...]`` (adjacent pairs); this reshapes
    ``[H, d/2, 2, ...]`` and swaps the middle axes back.
    """
    half = w.shape[0] // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
