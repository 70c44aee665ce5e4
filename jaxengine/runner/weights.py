"""New weights for a running engine, by Hugging Face tensor name (`LLM.update_weights`).

An RL trainer pushes its weights into the rollout engine between batches. Each tensor
goes where the loader would have put it (`loader.params.tensor_slot`, the same name
mapping): q/k/v and gate/up rows of a fused projection, one expert of a stacked leaf,
the shards of a tensor- or pipeline-parallel layout (a tied embedding into both
pipeline stages that hold it), re-quantized for a quantized engine (its scheme, on
device). LoRA adapter slots are separate leaves: the base changes under them.

`plan_update` checks every tensor first (a name with no place in the model, a wrong
shape, a non-float dtype: `CheckpointError` naming the tensor) and `apply_update`
builds the new leaves beside the old ones, so a bad update changes nothing and a
failed one leaves the engine's parameters as they were. Arrays that are already
`jax.Array`s, sharded any way on any devices, move to the leaf's sharding device to
device (`resharded`), with no host round trip; numpy arrays are placed shard by
shard; torch tensors are taken through DLPack.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import (
    checkpoint_names,
    family_tensors,
    is_quantized,
    leaf_at,
    place,
    plain_tree,
    tensor_slot,
)
from jaxengine.models.layers.mlp import checkpoint_transposed
from jaxengine.models.layers.quant import quantize

Path = tuple[str, ...]
Piece = tuple[Any, Any]  # (index: None | int | slice, array)


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How checkpoint names map onto one engine's parameters: the model module (its
    name mapping), its `TransformerConfig`, the parameters' shapes and dtypes (the
    tree as loaded) and the source, for error messages."""

    module: Any
    config: Any
    shapes: Any
    source: str

    @classmethod
    def of(cls, loaded: Any) -> WeightLayout:
        shapes = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain_tree(loaded.params)
        )
        return cls(loaded.module, loaded.config, shapes, str(loaded.source.path))


def as_array(value: Any, name: str) -> Any:
    """A `jax.Array` or numpy array of a weight given as jax, numpy or torch."""
    if isinstance(value, jax.Array | np.ndarray):
        return value
    if type(value).__module__.split(".")[0] == "torch":
        return jax.dlpack.from_dlpack(value.detach().contiguous())
    try:
        return np.asarray(value)
    except Exception as e:  # a type numpy cannot read
        raise CheckpointError(f"tensor {name!r}: {type(value).__name__} is not an array") from e


def _items(weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    return weights.items() if isinstance(weights, Mapping) else weights


def plan_update(
    layout: WeightLayout, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]
) -> dict[Path, list[Piece]]:
    """leaf path -> the pieces written into it, every tensor checked; raises
    `CheckpointError` naming the first bad tensor (nothing is applied then)."""
    names = checkpoint_names(layout.module)
    plan: dict[Path, list[Piece]] = {}
    seen: set[str] = set()
    for name, value in family_tensors(layout.module, layout.config, _items(weights)):
        if name in seen:
            raise CheckpointError(f"tensor {name!r} is given twice")
        seen.add(name)
        array = as_array(value, name)
        if not jnp.issubdtype(array.dtype, jnp.floating) and not is_quantized(array.dtype):
            raise CheckpointError(
                f"tensor {name!r} has dtype {np.dtype(array.dtype).name}: weights are "
                "floating-point"
            )
        slot = tensor_slot(names(name), name, array, layout.config, layout.shapes, "update_weights")
        if slot is None:
            continue
        path, index, _, leaf = slot
        if is_quantized(array.dtype) and np.dtype(array.dtype) != np.dtype(leaf.dtype):
            raise CheckpointError(
                f"tensor {name!r} is {np.dtype(array.dtype).name}; the engine keeps it in "
                f"{np.dtype(leaf.dtype).name}"
            )
        plan.setdefault(path, []).append((index, array))
    return plan


def apply_update(params: Any, plan: dict[Path, list[Piece]], layout: WeightLayout) -> Any:
    """``params`` (a tree, or a list of pipeline stages' trees) with the plan's leaves
    replaced; the input trees are not modified."""
    trees = params if isinstance(params, list) else [params]
    new_trees = [plain_tree(tree) for tree in trees]
    scheme = layout.config.quantization
    for path, pieces in plan.items():
        leaf = leaf_at(layout.shapes, path)
        holders = [t for t in new_trees if leaf_at(t, path) is not None]
        if not holders:
            raise CheckpointError(f"{'/'.join(path)} is not held by this engine")
        for tree in holders:
            for target, array in _new_leaves(tree, path, pieces, leaf, scheme).items():
                _set(tree, target, array)
    return new_trees if isinstance(params, list) else new_trees[0]


def _new_leaves(tree: dict, path: Path, pieces: list[Piece], leaf: Any, scheme: Any) -> dict:
    """target path -> new array, for every leaf the pieces write (a quantized weight
    writes its ``_scale`` sibling too). Pieces come as the checkpoint orients them;
    a leaf stored transposed (the MoE experts, `checkpoint_transposed`) takes them
    swapped."""
    out: dict[Path, Any] = {}
    for index, array in pieces:
        parts = {"": array}
        if is_quantized(leaf.dtype) and np.dtype(array.dtype) != np.dtype(leaf.dtype):
            parts = quantize(_on_device(array), scheme, jnp)
        for suffix, value in parts.items():
            target = (*path[:-1], path[-1] + suffix)
            old = out.get(target, leaf_at(tree, target))
            if checkpoint_transposed(target[-1], old.ndim):  # [E, in, out]
                value = value.swapaxes(-1, -2)
            out[target] = _written(old, value, index)
    return out


def _on_device(array: Any) -> jax.Array:
    return array if isinstance(array, jax.Array) else jnp.asarray(array)


def _written(old: jax.Array, value: Any, index: Any) -> jax.Array:
    """``old`` with ``value`` as its whole (index None) or at ``index``, in ``old``'s
    dtype and sharding."""
    if index is None:
        if isinstance(value, jax.Array):
            return resharded(value.astype(old.dtype), old.sharding)
        return place(value, old.dtype, old.sharding)
    whole = _replicated(old.sharding)
    value = resharded(_on_device(value).astype(old.dtype), whole)
    if isinstance(index, int):  # one expert of a stacked leaf
        value, index = jnp.expand_dims(value, 0), slice(index, index + 1)
    start = (index.start or 0,) + (0,) * (old.ndim - 1)
    return resharded(_write_rows(old, value, start), old.sharding)


@functools.partial(jax.jit, static_argnums=2)
def _write_rows(old: jax.Array, rows: jax.Array, start: tuple[int, ...]) -> jax.Array:
    """``old`` with ``rows`` written from ``start`` (compiled: an eager ``.at[]`` sends
    its index to the device, a host transfer)."""
    return jax.lax.dynamic_update_slice(old, rows, start)


def resharded(value: jax.Array, sharding: Any) -> jax.Array:
    """``value`` in ``sharding``, device to device. `jax.device_put` copies an array
    held by one device (or whose shards the destination's are) between devices, but
    reads any other multi-device array, a trainer's FSDP-sharded weight, back through
    the host: such an array is resharded by a compiled identity when both shardings
    span the same devices, else gathered whole on its own devices first and copied
    from one of them."""
    src = value.sharding
    if (
        len(src.device_set) == 1
        or not value.is_fully_addressable
        or src.is_equivalent_to(sharding, value.ndim)
    ):
        return jax.device_put(value, sharding, may_alias=False)  # the engine owns its copy
    # a jitted function's inputs and outputs span the same devices in the same order
    devices = src._device_assignment
    if devices == sharding._device_assignment:
        return jax.jit(lambda x: x, out_shardings=sharding)(value)
    whole = NamedSharding(jax.sharding.Mesh(np.array(devices), ("all",)), PartitionSpec())
    gathered = jax.jit(lambda x: x, out_shardings=whole)(value)
    return jax.device_put(gathered.addressable_shards[0].data, sharding)


def _replicated(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


def _set(tree: dict, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
