"""Building a model's parameter tree: from checkpoint tensors, or random (dummy).

The target tree comes from `jax.eval_shape` of the module's init, so shapes, dtypes
and logical axis names are the model's own; checkpoint tensors are matched to it by
their Hugging Face names (`checkpoint_names`: the decoders' `layers.decoder.hf_param_path`,
or a family's own, such as `models.bert`'s). Every leaf must be filled
exactly once with the right shape, else `CheckpointError` names the tensor. A model
with `fused_projections` holds ``qkv_proj`` and ``gate_up_proj``: the checkpoint's
q/k/v and gate/up tensors are concatenated into them here, once. The MoE experts are
stored ``[E, in, out]`` (`layers.mlp.checkpoint_transposed`): their tensors are read
and checked as the checkpoint orients them (``[out, in]``) and swapped as they are
placed, once. A quantized checkpoint weight whose leaf the model holds in float (MLA's
``kv_b_proj``) is dequantized as it is read (`float_where_held`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxengine.loader.errors import CheckpointError
from jaxengine.models.layers.attention import KV_SCALES, kv_cache_shape
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import fused_name, fused_param_path, hf_param_path
from jaxengine.models.layers.gated_delta import layer_state_shapes
from jaxengine.models.layers.lora import LORA_LEAVES
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.models.layers.mlp import checkpoint_transposed
from jaxengine.models.layers.quant import METHODS, SUFFIXES, dequantize, quantize

NameMapper = Callable[[str], tuple[tuple[str, ...], int | None] | None]
"""A checkpoint tensor name -> (parameter path, stacked index), or None to skip it."""


def checkpoint_names(module: nn.Module) -> NameMapper:
    """How ``module``'s checkpoint names map to its parameters: its class's static
    ``hf_param_path`` where the family defines one (`models.bert`), else the decoders'
    (`layers.decoder.hf_param_path`)."""
    return getattr(type(module), "hf_param_path", hf_param_path)


def family_tensors(module: nn.Module, config: TransformerConfig, tensors: Iterable) -> Iterable:
    """The checkpoint's ``(name, array)`` pairs as ``module``'s names expect them: its
    class's static ``split_tensors(tensors, config)`` first where the family defines one
    (a checkpoint that fuses what the model holds apart, `models.phi3`)."""
    split = getattr(type(module), "split_tensors", None)
    return tensors if split is None else split(tensors, config)


def init_inputs(config: TransformerConfig) -> tuple:
    """Smallest valid forward inputs (one token, one page), for init and shapes."""
    page = kv_cache_shape(config, 1, 1)
    states = layer_state_shapes(config, 1)  # a hybrid model's linear-attention layers
    kv_caches = tuple(
        jnp.zeros(page, config.dtype) if s is None else tuple(jnp.zeros(x) for x in s)
        for s in states or (None,) * config.num_layers
    )
    md = AttentionMetadata(
        seq_lens=jnp.ones((1,), jnp.int32),
        query_start_loc=jnp.array([0, 1], jnp.int32),
        page_table=jnp.zeros((1, 1), jnp.int32),
        slot_mapping=jnp.zeros((1,), jnp.int32),
        num_seqs=jnp.array(1, jnp.int32),
        state_rows=None if states is None else jnp.zeros((1,), jnp.int32),
    )
    return jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), kv_caches, md


def abstract_params(module: nn.Module, config: TransformerConfig) -> Any:
    """The boxed (logically partitioned) ShapeDtypeStruct tree of the parameters.

    The attention and cache-write functions hold no parameters, so the shapes are
    traced with stand-ins that return their input (`SHAPES_ONLY`): tracing the
    attention kernel's loops in every layer took half of SmolLM2's shape pass."""
    if "attention_kwargs" in {f.name for f in dataclasses.fields(module)}:
        module = module.clone(attention_kwargs=SHAPES_ONLY)
    inputs = init_inputs(config)
    return jax.eval_shape(
        lambda: module.init(jax.random.key(0), *inputs, method="forward_and_logits")
    )["params"]


def _attention_shape(q: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    return q  # [T, Hq, D], as attention's output


def _cache_unchanged(kv_cache: jax.Array, *args: Any) -> jax.Array:
    return kv_cache


SHAPES_ONLY = {"attention_fn": _attention_shape, "update_fn": _cache_unchanged}
"""`abstract_params`' attention: the shapes of the backends' functions, no work."""


def placed_shapes(abstract: Any, shardings: Any) -> Any:
    """``abstract``'s shapes with each leaf's sharding (None: unplaced): the
    parameters of a compile-only engine."""
    if shardings is None:
        return abstract
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def logical_axes(abstract: Any) -> Any:
    """Tree of logical-axis PartitionSpecs, one per parameter (for `sharding/`)."""
    return nn.get_partition_spec(abstract)


DUMMY_STD = 0.02  # the layers' own initializer scale (`layers.basic._INIT_STD`)
DUMMY_QUANT_SCALE = 3 * DUMMY_STD / 127  # quantized dummy weights: 3 std at int8's largest
DUMMY_INT4_SCALE = DUMMY_STD / 4.6  # uniform 0..15 has std 4.6; offset -7.5 scales centres it
DUMMY_MXFP4_SCALE = 127 - 7  # e8m0 2^-7: random e2m1 codes (rms 2.9) -> std about 0.023


def is_quantized(dtype: Any) -> bool:
    """Whether a parameter of ``dtype`` holds quantized values (`layers.quant`)."""
    return any(np.dtype(dtype) == np.dtype(d) for d, _ in METHODS.values())


def dummy_params(
    module: nn.Module, config: TransformerConfig, seed: int = 0, shardings: Any = None
) -> Any:
    """Random parameters of the right shapes and dtypes.

    Leaf by leaf, as the layers initialize them (normal(0, 0.02) weights, zero biases,
    RMSNorm scales of 1, or 0 with Gemma's +1 offset). A leaf of at most
    `HOST_FILL_MAX` values is drawn on the host (numpy) and placed: no program to
    compile per leaf shape. A larger one is drawn on device, each in its own small
    program with XLA's RngBitGenerator ("rbg" keys): the whole model's init in one
    program, or threefry's counters, hold several times the weights' bytes in
    temporaries (over 20 GiB for a 4-layer Llama-3-8B). With ``shardings`` (a
    `NamedSharding` per leaf) each device holds, and for large leaves computes, only
    its own shard. Dummy weights are for profiling: the values are reproducible for
    one layout, not across layouts.
    """
    boxed = abstract_params(module, config)
    abstract, logical = nn.unbox(boxed), logical_axes(boxed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    specs = jax.tree_util.tree_leaves(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
    placed = [None] * len(flat) if shardings is None else jax.tree_util.tree_leaves(shardings)
    key = jax.random.key(seed, impl="rbg")
    norm_value = 0.0 if config.norm_offset else 1.0
    leaves = []
    for i, ((path, leaf), spec, sharding) in enumerate(zip(flat, specs, placed, strict=True)):
        name = getattr(path[-1], "key", str(path[-1]))
        kind = _dummy_kind(name, tuple(spec), leaf.dtype, config.quantization)
        if math.prod(leaf.shape) <= HOST_FILL_MAX:
            rng = np.random.default_rng((seed, i))
            draw = functools.partial(_host_draw, rng, leaf.shape)
            values = _dummy_values(np, draw, leaf.shape, np.dtype(leaf.dtype), kind, norm_value)
            leaves.append(place(values, leaf.dtype, sharding))
            continue
        fill = _dummy_fill(leaf.shape, np.dtype(leaf.dtype).name, kind, norm_value, sharding)
        leaves.append(fill(jax.random.fold_in(key, i)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


HOST_FILL_MAX = 1 << 22
"""Dummy leaves of at most this many values (16 MiB in float32) are drawn with numpy:
a tiny model's init otherwise compiled a program for each of its leaf shapes (about
0.2 s each on CPU, more than the values take to draw)."""


_DUMMY_SIDE = {
    "scale": DUMMY_QUANT_SCALE,
    "int4_scale": DUMMY_INT4_SCALE,
    "int4_offset": -7.5 * DUMMY_INT4_SCALE,
    "mxfp4_scale": DUMMY_MXFP4_SCALE,
}
"""Constant fills of quantized weights' side leaves, by `_dummy_kind`."""


def _dummy_kind(name: str, spec: tuple, dtype: Any, scheme: Any) -> str:
    if name == "bias" or name.endswith("_g_idx"):  # act-order groups: all columns in 0
        return "zeros"
    if name in KV_SCALES:
        return "ones"
    if name in LORA_LEAVES:  # empty adapter slots
        return "zeros"
    if spec in (("norm",), ("head_dim",)):
        return "norm"
    if scheme is not None and scheme.method == "mxfp4" and name.endswith("_scale"):
        return "mxfp4_scale"  # e8m0 exponents: random bytes would reach 2^128
    if np.dtype(dtype) == np.uint8:
        return "int4"
    if is_quantized(dtype):
        return "quantized"
    if scheme is not None and name.endswith(("_scale", "_offset")):  # of a quantized weight
        side = name.rsplit("_", 1)[1]
        return f"int4_{side}" if scheme.method == "int4" else side
    return "normal"


def _dummy_values(xp, draw, shape: tuple, dtype: Any, kind: str, norm_value: float):
    """A leaf of `_dummy_kind` ``kind`` with the array module ``xp`` (numpy or jax.numpy);
    ``draw("normal")`` gives standard normal float32 values, ``draw("int4")`` uniform
    integers in [0, 256)."""
    if kind == "zeros":
        return xp.zeros(shape, dtype)
    if kind == "norm":
        return xp.full(shape, norm_value, dtype)
    if kind == "ones":
        return xp.ones(shape, dtype)
    if kind in _DUMMY_SIDE:
        return xp.full(shape, _DUMMY_SIDE[kind], dtype)
    if kind == "int4":
        return draw("int4").astype(dtype)
    normal = draw("normal")
    if kind == "quantized":  # q * DUMMY_QUANT_SCALE ~ normal(0, DUMMY_STD), clipped
        return xp.clip(xp.round(normal * DUMMY_STD / DUMMY_QUANT_SCALE), -127, 127).astype(dtype)
    return (DUMMY_STD * normal).astype(dtype)


def _host_draw(rng: np.random.Generator, shape: tuple, what: str) -> np.ndarray:
    if what == "int4":
        return rng.integers(0, 256, shape, dtype=np.int32)
    return rng.standard_normal(shape, dtype=np.float32)


def _device_draw(key: jax.Array, shape: tuple, what: str) -> jax.Array:
    if what == "int4":
        return jax.random.randint(key, shape, 0, 256, jnp.int32)
    return jax.random.normal(key, shape, jnp.float32)


@functools.cache
def _dummy_fill(shape: tuple, dtype: str, kind: str, norm_value: float, sharding: Any):
    def fill(key):
        draw = functools.partial(_device_draw, key, shape)
        return _dummy_values(jnp, draw, shape, dtype, kind, norm_value)

    return jax.jit(fill, out_shardings=sharding)


def place(array: np.ndarray, dtype: Any, sharding: Any = None) -> jax.Array:
    """A host tensor on device(s): each device receives only its shard (no full copy
    on one device first) when ``sharding`` is given."""
    if sharding is None:
        return jnp.asarray(array, dtype=dtype)
    host = np.asarray(array).astype(dtype, copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _tree_set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def leaf_at(shapes: Any, path: tuple[str, ...]) -> Any:
    node = shapes
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if not isinstance(node, dict) else None


def params_from_tensors(
    module: nn.Module,
    config: TransformerConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    source: str,
    abstract: Any = None,
    shardings: Any = None,
) -> Any:
    """Fills the model's parameter tree from ``(hf_name, array)`` pairs.

    Stacked (per-expert) tensors, and the q/k/v or gate/up tensors of a model with
    `fused_projections`, are assembled in host memory (each into its rows of the one
    leaf) and go to the device once complete: the fused weights are concatenated
    here, once, never per step. Tensors the model has no use for (a tied
    checkpoint's ``lm_head.weight``, rotary buffers) are skipped; missing tensors and
    shape mismatches raise `CheckpointError` naming the tensor and ``source``.
    ``abstract`` is `abstract_params`' result when the caller has it already;
    ``shardings`` (same tree, `NamedSharding` leaves) places each tensor straight
    into its shards.
    """
    if abstract is None:
        abstract = abstract_params(module, config)
    shapes = plain_tree(nn.unbox(abstract))
    out = plain_tree(shapes, fill=None)
    placement = plain_tree(shardings) if shardings is not None else None
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    filled: dict[tuple[str, ...], set] = {}
    names = checkpoint_names(module)
    tensors = family_tensors(module, config, tensors)
    for name, array in float_where_held(tensors, names, shapes, config.quantization):
        slot = tensor_slot(names(name), name, array, config, shapes, source)
        if slot is None:
            continue
        path, index, parts, leaf = slot
        if index is None:
            _fill(out, path, array, leaf, placement, config.quantization)
            continue
        kept = array.dtype if array.dtype == leaf.dtype else np.float32  # quantized at _fill
        buffers.setdefault(path, np.empty(leaf.shape, kept))[index] = array
        done = filled.setdefault(path, set())
        done.add(index if isinstance(index, int) else index.start)
        if len(done) == parts:
            _fill(out, path, buffers.pop(path), leaf, placement, config.quantization)
    _default_leaves(out, placement, shapes=shapes)
    missing = list(_unfilled(out))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(
            f"{source}: {len(missing)} tensors missing from the checkpoint: {shown}"
        )
    return out


def float_where_held(
    tensors: Iterable[tuple[str, np.ndarray]], names: NameMapper, shapes: Any, scheme: Any
) -> Iterable[tuple[str, np.ndarray]]:
    """``tensors`` with each quantized weight that the model holds in float (MLA's
    ``kv_b_proj``, `layers.mla`) dequantized with ``scheme`` (float32, emitted once its
    ``weight`` and scale leaves have all been read); the rest as they come. A part left
    without the others goes on as it is, for `params_from_tensors` to name."""
    if scheme is None:
        yield from tensors
        return
    need = {"", "_scale"} | ({"_offset"} if scheme.has_offset else set())
    need |= {"_g_idx"} if scheme.act_order else set()
    held: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    for name, array in tensors:
        part = _float_part(name, array, names, shapes)
        if part is None:
            yield name, array
            continue
        module, suffix = part
        parts = held.setdefault(module, {})
        parts[suffix] = (name, array)
        if set(parts) == need:
            leaves = {s: np.asarray(a) for s, (_, a) in held.pop(module).items()}
            yield f"{module}.weight", dequantize(leaves, scheme, np).astype(np.float32)
    for parts in held.values():
        yield from parts.values()


def _float_part(name: str, array: np.ndarray, names: NameMapper, shapes: Any):
    """``(module, suffix)`` of a quantized weight's part (suffix "" the values) whose
    weight the model holds in float; None for any other tensor."""
    module, _, leaf_name = name.rpartition(".")
    suffix = leaf_name.removeprefix("weight")
    mapped = names(name) if leaf_name.startswith("weight") else None
    if mapped is None or (suffix and suffix not in SUFFIXES):
        return None
    path = mapped[0]
    if suffix == "" and not is_quantized(array.dtype):
        return None
    if suffix and leaf_at(shapes, path) is not None:
        return None
    weight = leaf_at(shapes, (*path[:-1], path[-1].removesuffix(suffix)))
    if weight is None or is_quantized(weight.dtype):
        return None
    return module, suffix


def _default_leaves(out: dict, placement: Any, path: tuple[str, ...] = (), shapes=None) -> None:
    """Fills what no checkpoint holds: KV scales of 1, and empty LoRA slots (zeros,
    shaped and typed as ``shapes`` says)."""
    for key, value in out.items():
        if isinstance(value, dict):
            _default_leaves(value, placement, (*path, key), shapes)
        elif value is None and key in KV_SCALES:
            sharding = leaf_at(placement, (*path, key)) if placement else None
            out[key] = place(np.ones((), np.float32), np.float32, sharding)
        elif value is None and key in LORA_LEAVES:
            leaf = leaf_at(shapes, (*path, key))
            sharding = leaf_at(placement, (*path, key)) if placement else None
            out[key] = jnp.zeros(leaf.shape, leaf.dtype, device=sharding)


def _fill(
    out: dict, path: tuple[str, ...], array: np.ndarray, leaf: Any, placement: Any, scheme: Any
) -> None:
    """Places a complete leaf. A float tensor for a quantized leaf (`layers.quant`) is
    quantized here with the model's scheme, filling the sibling ``_scale`` leaves
    too; a tensor stored in the leaf's own dtype (a quantized checkpoint) goes as is.
    ``array`` and ``leaf`` are as the checkpoint orients them (`tensor_slot`); a leaf
    stored transposed (`checkpoint_transposed`) is swapped here."""
    if is_quantized(leaf.dtype) and np.dtype(array.dtype) != np.dtype(leaf.dtype):
        leaves = quantize(array, scheme, np)
    elif is_quantized(array.dtype) and not is_quantized(leaf.dtype):
        raise CheckpointError(
            f"{'.'.join(path)} is stored quantized ({array.dtype}); the model keeps it in "
            f"{np.dtype(leaf.dtype).name}"
        )
    else:  # (a per-tensor scale may be stored as [1])
        leaves = {"": array.reshape(()) if leaf.shape == () else array}
    for suffix, value in leaves.items():
        target = (*path[:-1], path[-1] + suffix)
        sharding = leaf_at(placement, target) if placement else None
        dtype = leaf.dtype if not suffix else value.dtype
        if checkpoint_transposed(target[-1], value.ndim):
            value = value.swapaxes(-1, -2)  # a view: each shard is copied out of it
        _tree_set(out, target, place(value, dtype, sharding))


def tensor_slot(
    mapped: Any, name: str, array: np.ndarray, config: TransformerConfig, shapes: Any, source: str
):
    """``(path, index, parts, leaf)`` of a checkpoint tensor, or None to skip it.

    ``mapped`` is the tensor's ``(path, index)`` from `checkpoint_names`. ``index`` is
    None (the tensor is the whole leaf), an int (one expert of a stacked leaf) or a
    slice of rows (one projection of a fused leaf); ``parts`` is how many tensors fill
    the leaf; ``leaf`` its shape and dtype as the checkpoint orients it (a leaf stored
    transposed, `layers.mlp.checkpoint_transposed`, swapped back). Checks the tensor's
    shape against its place.
    """
    if mapped is None:
        return None
    path, index = mapped
    leaf, parts = leaf_at(shapes, path), 1
    if leaf is None and config.fused_projections and len(path) > 1 and fused_name(path[-2]):
        fused = leaf_at(shapes, (*path[:-2], fused_name(path[-2]), path[-1]))
        if fused is not None:
            path, index, parts = fused_param_path(path, config, fused.shape[0])
            leaf = fused
    if leaf is None:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None
        if name.endswith(".bias") and not np.any(array):  # GPTQ writes zero biases
            return None
        if path[-1] in KV_SCALES:  # the cache is not fp8: nothing uses them
            return None
        raise CheckpointError(f"{source}: tensor {name!r} has no place in the model")
    if checkpoint_transposed(path[-1], len(leaf.shape)):  # stored [E, in, out]
        *lead, inp, out = leaf.shape
        leaf = jax.ShapeDtypeStruct((*lead, out, inp), leaf.dtype)
    if np.dtype(leaf.dtype) == np.uint8 and np.dtype(array.dtype) != np.uint8:
        # a float weight for packed int4 (two per byte): the float shape, packed at _fill
        leaf = jax.ShapeDtypeStruct((*leaf.shape[:-1], 2 * leaf.shape[-1]), leaf.dtype)
    if isinstance(index, int):
        parts, expected = leaf.shape[0], leaf.shape[1:]
    elif isinstance(index, slice):
        expected = (index.stop - index.start, *leaf.shape[1:])
    else:
        expected = leaf.shape
    if tuple(array.shape) != tuple(expected) and not (expected == () and array.size == 1):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
            f"the model expects {tuple(expected)}"
        )
    return path, index, parts, leaf


def plain_tree(tree: Any, fill: Any = ...) -> Any:
    """A mutable nested dict copy of a parameter tree (optionally with every leaf = fill)."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: plain_tree(v, fill) for k, v in tree.items()}
    return tree if fill is ... else fill


def _unfilled(tree: dict, prefix: str = ""):
    """Paths (``a/b/c``) of leaves still None."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _unfilled(value, f"{prefix}{key}/")
        elif value is None:
            yield f"{prefix}{key}"
