"""One host-to-device copy per step: a pytree of numpy arrays packed by dtype.

Copying a dozen small arrays one by one costs far more than their bytes; packing them
into one buffer per dtype makes a step's inputs one or two transfers. The `TreeSpec`
(shapes, dtypes, tree structure) is static: the jitted function receives it as a
static argument and slices the buffers back into the tree at trace time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """How to cut packed buffers back into a pytree (hashable: a static argument)."""

    treedef: Any
    leaves: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype name, shape) per leaf
    dtypes: tuple[str, ...]  # one buffer per dtype, in this order


def pack_tree(tree: Any) -> tuple[tuple[np.ndarray, ...], TreeSpec]:
    """Flat buffers (one per dtype) and the spec to rebuild ``tree`` from them."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    dtypes = tuple(dict.fromkeys(x.dtype.name for x in leaves))
    buffers = tuple(
        np.concatenate([x.ravel() for x in leaves if x.dtype.name == name]) for name in dtypes
    )
    spec = TreeSpec(treedef, tuple((x.dtype.name, x.shape) for x in leaves), dtypes)
    return buffers, spec


def unpack_tree(buffers: tuple, spec: TreeSpec) -> Any:
    """Inverse of `pack_tree`, usable inside jit (static slices)."""
    offsets = dict.fromkeys(spec.dtypes, 0)
    index = {name: i for i, name in enumerate(spec.dtypes)}
    leaves = []
    for name, shape in spec.leaves:
        size = int(np.prod(shape, dtype=np.int64))
        start = offsets[name]
        leaves.append(buffers[index[name]][start : start + size].reshape(shape))
        offsets[name] = start + size
    return jax.tree_util.tree_unflatten(spec.treedef, leaves)
