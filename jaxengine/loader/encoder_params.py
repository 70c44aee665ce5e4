"""A vision encoder's parameter tree from checkpoint tensors (or random ones).

The image encoders (`models.vision`: `idefics3.Idefics3VisionEncoder`,
`gemma3.Gemma3VisionEncoder`, `qwen2_5_vl.Qwen2_5_VisionTransformer`) each map
checkpoint names to parameter paths with a static ``hf_param_path`` (the
`loader.params.NameMapper` contract). `params_from_tensors` streams a whole
vision-language checkpoint's ``(name, array)`` pairs (`loader.safetensors_io.
iter_safetensors`, or a transformers model's ``state_dict()``), keeps the encoder's
tensors, skips the decoder's, and checks that every leaf is filled once with its
shape. The decoder's weights are the text model's loader's business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import leaf_at, place, plain_tree


def abstract_params(module: nn.Module, *example_inputs: Any) -> Any:
    """The unboxed ShapeDtypeStruct tree of ``module``'s parameters."""
    boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), *example_inputs))
    return nn.unbox(boxed["params"])


def params_from_tensors(
    names: Callable[[str], tuple[tuple[str, ...], None] | None],
    abstract: Any,
    tensors: Iterable[tuple[str, Any]],
    source: str,
) -> dict:
    """Fills ``abstract`` (`abstract_params`) from ``(hf_name, array)`` pairs.

    ``names`` is the encoder's ``hf_param_path``; tensors it maps to None are skipped.
    A mapped tensor with no leaf, a shape mismatch, a tensor given twice, or a leaf
    left empty raises `CheckpointError` naming it and ``source``. Arrays may be
    numpy or torch (CPU) tensors; each leaf is cast to the parameter's dtype.
    """
    shapes = plain_tree(abstract)
    out = plain_tree(shapes, fill=None)
    for name, array in tensors:
        mapped = names(name)
        if mapped is None:
            continue
        path, _ = mapped
        leaf = leaf_at(shapes, path)
        if leaf is None:
            raise CheckpointError(f"{source}: tensor {name!r} has no place in the model")
        host = _to_numpy(array)
        if tuple(host.shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(host.shape)}, "
                f"the model expects {tuple(leaf.shape)}"
            )
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        if parent[path[-1]] is not None:
            raise CheckpointError(f"{source}: tensor {name!r} is given twice")
        parent[path[-1]] = place(host, leaf.dtype)
    missing = ["/".join(p) for p, v in _leaves(out) if v is None]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(
            f"{source}: {len(missing)} tensors missing from the checkpoint: {shown}"
        )
    return out


def load_module_params(
    module: nn.Module, example_inputs: tuple, tensors: Iterable[tuple[str, Any]], source: str
) -> dict:
    """``module``'s parameters from a checkpoint's ``(name, array)`` pairs (the whole
    model's: the names its ``hf_param_path`` maps to None are skipped). Raises
    `CheckpointError` on a missing, extra, repeated or misshapen tensor."""
    abstract = abstract_params(module, *example_inputs)
    return params_from_tensors(module.hf_param_path, abstract, tensors, source)


def _to_numpy(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor (a state_dict)
        return array.detach().cpu().float().numpy()
    return np.asarray(array)


def _leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def dummy_module_params(module: nn.Module, example_inputs: tuple, seed: int) -> dict:
    """Random parameters of ``module`` (``--load-format dummy``): normal(0, 0.02),
    drawn on the host (an encoder's leaves are small: no program per leaf shape)."""
    shapes = abstract_params(module, *example_inputs)
    leaves, tree = jax.tree_util.tree_flatten(shapes)
    rng = np.random.default_rng(seed)
    drawn = [
        jax.numpy.asarray((0.02 * rng.standard_normal(s.shape, np.float32)).astype(s.dtype))
        for s in leaves
    ]
    return jax.tree_util.tree_unflatten(tree, drawn)
