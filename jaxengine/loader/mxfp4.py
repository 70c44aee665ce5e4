"""MXFP4 checkpoints (``quant_method: mxfp4``, gpt-oss): the experts' blocks and scales.

Such a checkpoint stores each quantized expert weight ``<w>`` of float shape
``[E, out, in]`` as two uint8 tensors (transformers' ``integrations/mxfp4.py``):

- ``<w>_blocks [E, out, in / 32, 16]``: e2m1 codes, two per byte, input column ``2k``
  of a block in the low nibble of byte ``k``;
- ``<w>_scales [E, out, in / 32]``: one e8m0 exponent per block of 32 columns,
  ``w = E2M1[code] * 2^(scale - 127)`` (`layers.quant.dequantize_mxfp4`).

Everything else (attention, router, embeddings, the experts' biases) is stored in
float. `mxfp4_tensors` pairs each weight's blocks with its scales and checks their
shapes; the family maps the pair onto its stacked ``mxfp4`` leaves
(`models.gpt_oss`), which keep the bytes as they are: no dequantization at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from jaxengine.loader.errors import CheckpointError
from jaxengine.models.layers.quant import MXFP4_BLOCK

PARTS = ("_blocks", "_scales")
"""The suffixes of the two tensors storing one MXFP4 weight."""

BLOCK_BYTES = MXFP4_BLOCK // 2
"""Bytes per block of 32 e2m1 values: the blocks' last dimension."""


def mxfp4_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], source: str
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each ``<w>_blocks`` and ``<w>_scales`` emitted
    together (blocks first) once both have been read, after `check_pair`; the other
    tensors pass through. A blocks tensor without its scales, or scales without
    blocks, is a `CheckpointError` naming the missing tensor."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        part = next((p for p in PARTS if name.endswith(p)), None)
        if part is None:
            yield name, array
            continue
        base = name.removesuffix(part)
        parts = pending.setdefault(base, {})
        parts[part] = array
        if len(parts) == len(PARTS):
            parts = pending.pop(base)
            check_pair(base, parts["_blocks"], parts["_scales"], source)
            yield base + "_blocks", parts["_blocks"]
            yield base + "_scales", parts["_scales"]
    for base, parts in pending.items():
        (have,) = parts
        missing = next(p for p in PARTS if p != have)
        raise CheckpointError(
            f"{source}: tensor {base + missing!r} missing beside {base + have!r} (mxfp4 checkpoint)"
        )


def check_pair(base: str, blocks: np.ndarray, scales: np.ndarray, source: str) -> None:
    """Refuses, naming the tensor, blocks that are not uint8 ``[..., G, 16]`` (32
    values per block) or scales that are not uint8 ``[..., G]`` of the blocks' shape."""
    if np.dtype(blocks.dtype) != np.uint8 or blocks.ndim < 2 or blocks.shape[-1] != BLOCK_BYTES:
        raise CheckpointError(
            f"{source}: tensor {base + '_blocks'!r} is {np.dtype(blocks.dtype).name} "
            f"{tuple(blocks.shape)}; MXFP4 blocks are uint8 [..., blocks, {BLOCK_BYTES}] "
            f"({MXFP4_BLOCK} values in {BLOCK_BYTES} bytes per block)"
        )
    if np.dtype(scales.dtype) != np.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(
            f"{source}: tensor {base + '_scales'!r} is {np.dtype(scales.dtype).name} "
            f"{tuple(scales.shape)}; the scales of {base + '_blocks'!r} "
            f"{tuple(blocks.shape)} are uint8 {tuple(blocks.shape[:-1])} (one per block)"
        )
