"""Writing LoRA adapters into the device's adapter slots, between steps.

The slots are parameters (`models.layers.lora`): every target projection's
``lora_a [in, L*r]`` and ``lora_b [L*r, out]`` (PEFT's A and B, transposed, one
block of r columns or rows per slot).
`LoRASlots.write` replaces one slot of every stack in one compiled call (the stacks
donated, so XLA updates them in place; the slot index is an argument, so any slot
uses the same executable), with
zeros for projections the adapter leaves alone. It is compiled at warm-up: swapping
adapters never compiles.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxengine.lora.peft import Weights
from jaxengine.lora.store import AdapterStore
from jaxengine.models.layers.decoder import hf_param_path
from jaxengine.models.layers.lora import LORA_LEAVES


class LoRASlots:
    """The adapter slots of one parameter tree and the host `AdapterStore` behind them."""

    def __init__(self, store: AdapterStore, params: Any) -> None:
        self.store = store
        self.modules = sorted(store.targets)
        self._index = _stack_indices(params, self.modules)
        self._write = jax.jit(_write, donate_argnums=(0,))
        self._compiled = None

    def assign(self, params: Any, requests: list) -> tuple[Any, list[int]]:
        """``(params, slots)``: each request's slot (its `LoRARequest` or None), with
        the adapters not yet resident written in."""
        slots, writes = self.store.assign(requests)
        for slot, weights in writes:
            params = self.write(params, slot, weights)
        return params, slots

    def write(self, params: Any, slot: int, weights: Weights) -> Any:
        """``params`` with ``weights`` in ``slot`` of every stack."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        stacks = tuple(leaves[i] for i in self._index)
        values = self._values(stacks, weights)
        fn = self._compiled or self._write
        new = fn(stacks, np.int32(slot - 1), values)  # slot s lives in block s - 1
        for i, leaf in zip(self._index, new, strict=True):
            leaves[i] = leaf
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def precompile(self, params: Any) -> None:
        """Compiles `write` for these stacks (warm-up)."""
        leaves = jax.tree_util.tree_leaves(params)
        stacks = tuple(leaves[i] for i in self._index)
        values = tuple(jax.ShapeDtypeStruct(self._value_shape(s, i), np.float32)
                       for i, s in enumerate(stacks))  # fmt: skip
        self._compiled = self._write.lower(stacks, np.int32(0), values).compile()

    def _value_shape(self, stack: Any, i: int) -> tuple[int, int]:
        """One slot's block of stack ``i`` (A's ``[in, r]``, B's ``[r, out]``)."""
        rows, cols = stack.shape
        loras = self.store.max_loras
        return (rows, cols // loras) if i % 2 == 0 else (rows // loras, cols)

    def _values(self, stacks: tuple, weights: Weights) -> tuple[np.ndarray, ...]:
        values = []
        for j, module in enumerate(self.modules):
            pair = weights.get(module)
            for k in range(2):
                shape = self._value_shape(stacks[2 * j + k], 2 * j + k)
                values.append(np.zeros(shape, np.float32) if pair is None else pair[k].T)
        return tuple(values)


def _write(stacks, block, values):
    """Each A's columns and each B's rows of slot block ``block``."""
    out = []
    for i, (stack, value) in enumerate(zip(stacks, values, strict=True)):
        value = value.astype(stack.dtype)
        start = (0, block * value.shape[1]) if i % 2 == 0 else (block * value.shape[0], 0)
        out.append(jax.lax.dynamic_update_slice(stack, value, start))
    return tuple(out)


def _stack_indices(params: Any, modules: list[str]) -> list[int]:
    """Leaf indices (in ``params``' flattening) of each module's ``lora_a``, ``lora_b``."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    where = {tuple(getattr(k, "key", str(k)) for k in path): i for i, (path, _) in enumerate(flat)}
    index = []
    for module in modules:
        path = hf_param_path(module + ".weight")[0][:-1]
        for leaf in LORA_LEAVES:
            if (*path, leaf) not in where:
                raise ValueError(f"the model has no LoRA slots at {'/'.join(path)}/{leaf}")
            index.append(where[(*path, leaf)])
    return index
