"""Sleep mode: an engine's device memory given up and taken back (`LLM.sleep`).

An RL trainer colocated with its rollout engine needs the accelerator memory between
rollouts. `SleepMode` frees what a runner holds on device and restores it as it was,
every array with its old shape, dtype and sharding, so the step functions compiled
at warm-up serve the woken engine as they are (no recompilation):

- level 1: the KV caches are freed and the weights copied to host memory (numpy);
- level 2: the KV caches and the weights are freed. The small leaves no checkpoint
  holds (KV-cache scales, LoRA adapter slots) are kept on host; the weights come back
  as zeros, to be filled by `update_weights` (or `reload_weights`).

``wake_up(("weights",))`` and ``wake_up(("kv_cache",))`` restore one part each (the
order RL trainers use: new weights in before the cache takes its memory back);
``wake_up()`` both. The KV caches come back zeroed: whatever they held is gone, so the
engine resets its prefix cache before sleeping.

A part is an object's attribute (the runner's ``params`` and ``kv_caches``, a draft
model's ``params`` and ``caches``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.layers.attention import KV_SCALES
from jaxengine.models.layers.lora import LORA_LEAVES
from jaxengine.runner.program import delete_arrays

TAGS = ("weights", "kv_cache")
"""What `wake_up` restores: vLLM's tags."""


@dataclasses.dataclass
class Parked:
    """One attribute while asleep: the arrays' shapes and shardings, and their host
    copies (None where the level dropped them)."""

    owner: Any
    attribute: str
    specs: Any  # ShapeDtypeStruct tree, shardings included
    host: Any  # numpy tree with None leaves where dropped


@dataclasses.dataclass(frozen=True)
class Part:
    """An attribute holding device arrays, and what `wake_up` tag restores it."""

    owner: Any
    attribute: str
    tag: str  # "weights" or "kv_cache"


class SleepMode:
    """Sleeps and wakes the ``parts`` of one runner."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.parked: dict[int, Parked] = {}  # index in parts -> parked state
        self.level = 0

    @property
    def sleeping(self) -> bool:
        return bool(self.parked)

    def asleep(self, tag: str) -> bool:
        return any(self.parts[i].tag == tag for i in self.parked)

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 or 2")
        if self.sleeping:
            raise RuntimeError("the engine is already asleep: wake_up() first")
        for i, part in enumerate(self.parts):
            tree = getattr(part.owner, part.attribute)
            _check_jax(tree, part.attribute)
            keep = _keep_weights if part.tag == "weights" and level == 1 else _keep_small
            if part.tag == "kv_cache":
                keep = _keep_nothing
            specs = jax.tree_util.tree_map(_spec, tree)
            host = _to_host(tree, keep)
            delete_arrays(tree)
            setattr(part.owner, part.attribute, None)
            self.parked[i] = Parked(part.owner, part.attribute, specs, host)
        self.level = level

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        tags = TAGS if tags is None else tuple(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown}: expected some of {list(TAGS)}")
        for i in [i for i in self.parked if self.parts[i].tag in tags]:
            parked = self.parked.pop(i)
            setattr(parked.owner, parked.attribute, _restore(parked.specs, parked.host))
        if not self.parked:
            self.level = 0


def _check_jax(tree: Any, attribute: str) -> None:
    leaves = jax.tree_util.tree_leaves(tree)
    if any(not isinstance(leaf, jax.Array) for leaf in leaves):
        raise NotImplementedError(
            f"sleep mode is not supported for this model's {attribute} (not JAX arrays: "
            "the transformers fallback)"
        )


def _spec(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _keep_weights(path: tuple, x: jax.Array) -> bool:
    return True


def _keep_small(path: tuple, x: jax.Array) -> bool:
    """Level 2 keeps the leaves no checkpoint holds: KV scales, LoRA slots."""
    name = str(getattr(path[-1], "key", path[-1])) if path else ""
    return name in KV_SCALES or name in LORA_LEAVES


def _keep_nothing(path: tuple, x: jax.Array) -> bool:
    return False


def _to_host(tree: Any, keep) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray(jax.device_get(x)) if keep(path, x) else None, tree
    )


def _restore(specs: Any, host: Any) -> Any:
    """The arrays of ``specs``: host copies placed back, zeros for dropped ones (made
    on device, in one program), each with its old sharding."""
    spec_leaves, treedef = jax.tree_util.tree_flatten(specs)
    host_leaves = treedef.flatten_up_to(host)
    dropped = [s for s, value in zip(spec_leaves, host_leaves, strict=True) if value is None]
    zeros = iter(_zeros(tuple(dropped)) if dropped else ())
    out = [
        next(zeros) if value is None else jax.device_put(value, spec.sharding)
        for spec, value in zip(spec_leaves, host_leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _zeros(specs: tuple[jax.ShapeDtypeStruct, ...]) -> tuple[jax.Array, ...]:
    """Zeros of each spec, one program per set of devices (pipeline stages hold their
    leaves on different devices, and one program runs on one set)."""
    groups: dict[frozenset, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(frozenset(d.id for d in spec.sharding.device_set), []).append(i)
    out: list[jax.Array | None] = [None] * len(specs)
    for indexes in groups.values():
        group = tuple(specs[i] for i in indexes)
        make = jax.jit(
            lambda group=group: tuple(jnp.zeros(s.shape, s.dtype) for s in group),
            out_shardings=tuple(s.sharding for s in group),
        )
        for i, array in zip(indexes, make(), strict=True):
            out[i] = array
    return tuple(out)


def runner_parts(runner: Any) -> list[Part]:
    """What sleep mode frees of a `ModelRunner`: its weights and KV caches, its draft
    model's (speculative decoding with a draft model or an EAGLE head), and its image
    encoder's weights and embedding rows (which the scheduler forgets at sleep, as it
    forgets cached prefixes)."""
    parts = [Part(runner, "params", "weights"), Part(runner, "kv_caches", "kv_cache")]
    encoder = getattr(runner, "encoder", None)
    if encoder is not None:
        parts += [Part(encoder, "params", "weights"), Part(encoder, "images", "kv_cache")]
    proposer = runner.proposer
    if hasattr(proposer, "params") and hasattr(proposer, "caches"):
        parts += [Part(proposer, "params", "weights"), Part(proposer, "caches", "kv_cache")]
    return parts
