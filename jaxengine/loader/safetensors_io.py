"""Safetensors checkpoints: tensors by name, lazily, from one file or a sharded folder.

The format is an 8-byte little-endian header length, a JSON header mapping each name
to ``{"dtype", "shape", "data_offsets"}``, then the raw little-endian data. It is
read here directly rather than through ``safetensors.safe_open(framework="numpy")``,
which has no bfloat16 (numpy lacks the type): arrays are read-only numpy views of a
memory map, typed with ``ml_dtypes`` for bfloat16 and float8, so nothing is copied or
converted on the host until the caller moves a tensor to the device. Every header is
checked before the first tensor is yielded, so a truncated file or a shard missing
from ``model.safetensors.index.json`` fails at once, naming the file.

With ``max_workers`` (``--max-parallel-loading-workers``) the shards are instead read
into host memory by a pool of that many threads, ahead of the caller: at most
``max_workers`` shards are held at once, which bounds the host RAM a large model
takes while it goes to the devices.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.sources import is_ignored

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


def safetensors_files(path: str | os.PathLike, ignore_patterns: Sequence[str] = ()) -> list[Path]:
    """The shard files of a checkpoint folder (or ``[path]`` for one file), in order.

    With ``model.safetensors.index.json`` the shards are the files its weight map
    names, each of which must exist (and must not match ``ignore_patterns``: the
    checkpoint would be incomplete); without it, every ``*.safetensors`` in the folder
    that does not match ``ignore_patterns`` (`sources.is_ignored`).
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
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shards that do not exist: {', '.join(missing)}")
        skipped = [n for n in names if is_ignored(n, ignore_patterns)]
        if skipped:
            raise CheckpointError(
                f"{index}: lists shards that --ignore-patterns skips: {', '.join(skipped)}"
            )
        return [path / n for n in names]
    files = sorted(f for f in path.glob("*.safetensors") if not is_ignored(f.name, ignore_patterns))
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


def iter_safetensors(
    path: str | os.PathLike,
    *,
    ignore_patterns: Sequence[str] = (),
    max_workers: int | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(name, array)`` for every tensor of a checkpoint folder or file.

    Arrays keep the stored dtype (``ml_dtypes.bfloat16`` for BF16) and are read-only.
    All headers are validated before the first tensor is yielded. Shards matching
    ``ignore_patterns`` are skipped (`safetensors_files`). With ``max_workers`` None
    the arrays are views of a memory map, read when the caller touches them; with
    ``max_workers`` N, N threads read whole shards into memory ahead of the caller
    (`_read_ahead`). Either way the tensors come in the same order.
    """
    files = safetensors_files(path, ignore_patterns)
    shards = [(f, entries) for f in files if (entries := read_safetensors_header(f)[0])]
    if max_workers is None:
        for file, entries in shards:
            yield from _mapped_tensors(file, entries)
    else:
        yield from _read_ahead(shards, max_workers)


def _mapped_tensors(file: Path, entries: list[TensorEntry]) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of one shard as views of a memory map of the file."""
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


def _read_shard(file: Path, entries: list[TensorEntry]) -> list[tuple[str, np.ndarray]]:
    """The tensors of one shard, read into one host buffer (one read of its data)."""
    start, end = entries[0].start, max(e.end for e in entries)
    buf = np.empty(end - start, np.uint8)
    try:
        with file.open("rb") as f:
            f.seek(start)
            got = f.readinto(memoryview(buf))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    if got != buf.size:  # the file shrank after the header check
        raise CheckpointError(f"{file}: truncated while reading its tensors")
    buf.flags.writeable = False
    return [
        (e.name, buf[e.start - start : e.end - start].view(e.dtype).reshape(e.shape))
        for e in entries
    ]


def _read_ahead(
    shards: Iterable[tuple[Path, list[TensorEntry]]], max_workers: int
) -> Iterator[tuple[str, np.ndarray]]:
    """The shards' tensors in order, read by ``max_workers`` threads ahead of the caller.

    A shard is submitted only while fewer than ``max_workers`` are read or held, so
    at most ``max_workers`` shards are in host memory at once (the one being yielded
    and those being read). Closing the iterator early cancels the reads not started.
    """
    pending: deque[Future] = deque()
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix="safetensors-load")
    try:
        for file, entries in shards:
            pending.append(pool.submit(_read_shard, file, entries))
            if len(pending) == max_workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
