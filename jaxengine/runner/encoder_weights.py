"""New weights by checkpoint name into a running image encoder (`LLM.update_weights`).

The decoder's names go to `runner.weights` (whose mapping skips the encoder's
tensors); the image encoder's (``model.vision_model.*``, ``vision_tower.*``, its
projector) come here, through the encoder module's own ``hf_param_path``. Every
tensor is checked before any is written: an unknown leaf or a shape that differs is
a `CheckpointError` naming it, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import leaf_at, plain_tree
from jaxengine.runner.weights import as_array, resharded

Path = tuple[str, ...]


def split_encoder_tensors(
    module: Any, params: Any, pairs: Iterable[tuple[str, Any]]
) -> tuple[dict[Path, Any], list[tuple[str, Any]]]:
    """(encoder leaf path -> array, the pairs that are not the encoder's), every
    encoder tensor checked against its leaf's shape."""
    mine: dict[Path, Any] = {}
    rest: list[tuple[str, Any]] = []
    for name, value in pairs:
        mapped = module.hf_param_path(name)
        if mapped is None:
            rest.append((name, value))
            continue
        path = mapped[0]
        leaf = leaf_at(params, path)
        array = as_array(value, name)
        if leaf is None:
            raise CheckpointError(f"tensor {name!r} has no place in the image encoder")
        if tuple(array.shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(array.shape)}, the image encoder "
                f"expects {tuple(leaf.shape)}"
            )
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise CheckpointError(f"tensor {name!r} is not floating-point")
        mine[path] = array
    return mine, rest


def apply_encoder_tensors(params: Any, planned: dict[Path, Any]) -> Any:
    """``params`` with the planned leaves replaced (each in its leaf's dtype and
    placement); the input tree is not modified."""
    tree = plain_tree(params)
    for path, array in planned.items():
        old = leaf_at(tree, path)
        new = resharded(jnp.asarray(array).astype(old.dtype), old.sharding)
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = new
    return jax.block_until_ready(tree)
