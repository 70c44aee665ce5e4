"""Safetensors checkpoints: tensors by name, lazily, from one file or a sharded folder.

The format is an 8-byte little-endian header length, a JSON header mapping each name
to ``{"dtype", "shape", "data_offsets"}``, then the raw little-endian data. It is
read here directly rather than through ``safetensors.safe_open(framework="numpy")``,
which has no bfloat16 (numpy lacks the type): arrays are read-only numpy views of a
memory map, typed with ``ml_dtypes`` for bfloat16 and float8, so nothing is copied or
converted on the host until the caller moves a tensor to the device. Every header is
checked before the first tensor is yielded, so a truncated file or a shard missing
from ``model.safetensors.index.json`` fails at once, naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxengine.loader.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on the JSON header
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: name, dtype, shape, absolute byte range."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The shard files of a checkpoint folder (or ``[path]`` for one file), in order.

    With ``model.safetensors.index.json`` the shards are the files its weight map
    names, each of which must exist; without it, every ``*.safetensors`` in the folder.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        shards = [path / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shards that do not exist: {', '.join(missing)}")
        return shards
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def read_safetensors_header(file: str | os.PathLike) -> tuple[list[TensorEntry], dict]:
    """The tensors (in data order) and ``__metadata__`` of one safetensors file.

    Raises `CheckpointError` naming the file when the header is unreadable or a
    tensor's data would lie past the end of the file.
    """
    file = Path(file)
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{file}: corrupt or truncated safetensors header")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    except ValueError as e:  # JSON or UTF-8 errors
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    entries = [_entry(file, 8 + n, size, name, info) for name, info in header.items()]
    entries.sort(key=lambda e: e.start)
    return entries, metadata


def _entry(file: Path, base: int, size: int, name: str, info: dict) -> TensorEntry:
    try:
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry") from None
    n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != n_bytes or begin < 0:
        raise CheckpointError(f"{file}: tensor {name!r}: data offsets do not match its shape")
    if base + end > size:
        raise CheckpointError(
            f"{file}: truncated: tensor {name!r} ends at byte {base + end}, the file has {size}"
        )
    return TensorEntry(name, dtype, shape, base + begin, base + end)


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(name, array)`` for every tensor of a checkpoint folder or file.

    Arrays keep the stored dtype (``ml_dtypes.bfloat16`` for BF16) and are read-only
    views of a memory map: pages are read when the caller touches them. All headers
    are validated before the first tensor is yielded.
    """
    files = safetensors_files(path)
    headers = [(f, read_safetensors_header(f)[0]) for f in files]
    for file, entries in headers:
        if not entries:
            continue
        try:
            data = np.memmap(file, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot map: {e}") from e
        for e in entries:
            raw = data[e.start : e.end]
            if raw.size != e.end - e.start:  # the file shrank after the header check
                raise CheckpointError(f"{file}: truncated while reading tensor {e.name!r}")
            yield e.name, raw.view(e.dtype).reshape(e.shape).view(np.ndarray)
        del data
