"""A stage program: how one engine's model runs on its devices.

`ModelRunner` does not know whether the model is one program on one tensor group or
a pipeline of stages on several. It asks a `StageProgram` to place the parameters,
allocate the KV caches, run a packed step, compute prompt logprobs, and copy pages
for swapping. Every call takes its device inputs and returns its outputs explicitly
(the caches included: they are donated and come back updated); a program holds
compiled functions and placement, never parameters or caches.

`SingleStage` is the program of one tensor group (one device, or a tensor-parallel
mesh); `runner.pipeline.PipelineStages` is the pipeline's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.executables import compile_ahead
from jaxengine.runner.step import (
    make_kv_calibration,
    make_prompt_logprobs,
    make_step,
    make_swap_fns,
    step_inputs,
)

if TYPE_CHECKING:
    from jax.sharding import Sharding

    from jaxengine.runner.executables import ExecutableStore
    from sharding.plan import ShardingPlan

Params = Any  # a pytree of device arrays (one per stage in a pipeline)
Caches = Any  # per-layer cache arrays (one tuple per stage in a pipeline)


class StageProgram(Protocol):
    """The device side of a model, as the runner drives it."""

    @property
    def logits_sharding(self) -> Sharding | None:
        """Where the step leaves the logits (where host logits must go back to)."""
        ...

    def place_params(self, params: Params) -> Params: ...

    def allocate_caches(self, shape: tuple, dtype: Any) -> Caches: ...

    def abstract_caches(self, shape: tuple, dtype: Any) -> Caches:
        """The caches `allocate_caches` would make, as placed shapes (nothing
        allocated): what a compile-only engine lowers its programs against."""
        ...

    def step(
        self, params: Params, caches: Caches, batch: PackedBatch, fed_ids: Any, images: Any = None
    ) -> tuple[Any, Any, Caches]:
        """``(logits[R, V], hidden[T, H], caches)`` of a packed batch. ``fed_ids``
        (``[max_num_seqs]`` int32 on device): the previous step's sampled ids, which
        the batch's ``feed_rows`` point into (async scheduling). ``images``: the image
        embeddings the batch's ``image_rows`` point into (`runner.encoder`), or None."""
        ...

    def prompt_logprobs(self, params: Params, hidden: Any, targets: np.ndarray) -> Any: ...

    def precompile(
        self, params: Params, caches: Caches, batch: PackedBatch, fed_ids: Any, images: Any = None
    ) -> None:
        """Compiles the step and prompt-logprobs functions for ``batch``'s shapes without
        running them (later calls with those shapes reuse the executables)."""
        ...

    def kv_amax(self, params: Params, caches: Caches, batch: PackedBatch, run: bool = True) -> Any:
        """``--calculate-kv-scales``: each attention layer's largest |k| and |v| over
        ``batch`` (`step.make_kv_calibration`), the caches left as they are; with
        ``run`` False, compiles the function for ``batch``'s shapes and returns None."""
        ...

    def gather(self, caches: Caches, ids: np.ndarray) -> list[np.ndarray]:
        """Pages ``ids`` of every layer, on the host."""
        ...

    def scatter(self, caches: Caches, ids: np.ndarray, pages: list[np.ndarray]) -> Caches: ...

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        """The step's requests (by index) in the groups that run as separate batches."""
        ...


def abstract_output(compiled: Any, shape: jax.ShapeDtypeStruct, index: int) -> Any:
    """``shape`` with the sharding the compiled function gives its output ``index``
    (left unset on one device, where an explicit sharding would not match the call)."""
    sharding = jax.tree_util.tree_leaves(compiled.output_shardings)[index]
    return _placed(shape, sharding)


def abstract_like(tree: Any) -> Any:
    """``tree``'s arrays as shapes to lower against, placed as they are (left unset on
    one device, as in `abstract_output`), so a compile made from them serves the
    calls with the arrays themselves. Leaves that are no JAX arrays (a PyTorch
    program's caches) stay as they are."""
    return jax.tree_util.tree_map(
        lambda x: _placed(x, x.sharding) if isinstance(x, jax.Array) else x, tree
    )


def _placed(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def delete_arrays(tree: Any) -> None:
    """Frees the device buffers of ``tree``'s JAX arrays (those not freed yet)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def zero_caches(shape: tuple, dtype: Any, count: int, sharding: Any = None) -> tuple:
    """``count`` zeroed cache arrays, created on device (placed by ``sharding``)."""
    placed = None if sharding is None else (sharding,) * count
    make = jax.jit(
        lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)), out_shardings=placed
    )
    return make()


class SingleStage:
    """The whole model as one program on one tensor group (``plan``; None: the default
    device). ``store``: where compiled steps persist across restarts (None: nowhere).
    ``pooling``: a pooling model's program (hidden states only).

    `precompile` keeps each bucket's executables (compiled, or loaded from the store
    without tracing) and `step` calls them directly; a shape never precompiled goes
    through the jitted function (``--enforce-eager``)."""

    def __init__(
        self,
        module: Any,
        num_layers: int,
        plan: ShardingPlan | None,
        k: int,
        store: ExecutableStore | None = None,
        pooling: bool = False,
    ) -> None:
        self.plan = plan
        self.num_layers = num_layers
        self.store = store
        self.pooling = pooling  # no logits, no prompt logprobs: a pooling model's program
        self._logits_sharding = plan.replicated if plan is not None else None
        self._step = make_step(module, self._logits_sharding, with_logits=not pooling)
        self._kv_amax = make_kv_calibration(module)
        self._kv_amaxes: dict[Any, Any] = {}  # batch spec -> compiled calibration
        self._prompt_lp = make_prompt_logprobs(module, k)
        self._gather, self._scatter = make_swap_fns()
        self._steps: dict[Any, Any] = {}  # batch spec -> compiled step
        self._prompt_lps: dict[int, Any] = {}  # tokens -> compiled prompt logprobs

    @property
    def logits_sharding(self) -> Sharding | None:
        return self._logits_sharding

    def place_params(self, params: Params) -> Params:
        return params  # the loader placed them by the plan

    def allocate_caches(self, shape: tuple, dtype: Any) -> Caches:
        sharding = None if self.plan is None else self.plan.kv_cache_sharding
        return zero_caches(shape, dtype, self.num_layers, sharding)

    def abstract_caches(self, shape: tuple, dtype: Any) -> Caches:
        cache = jax.ShapeDtypeStruct(shape, dtype)
        if self.plan is not None:
            cache = _placed(cache, self.plan.kv_cache_sharding)
        return (cache,) * self.num_layers

    def step(
        self, params: Params, caches: Caches, batch: PackedBatch, fed_ids: Any, images: Any = None
    ) -> tuple[Any, Any, Caches]:
        buffers, spec = step_inputs(batch)
        compiled = self._steps.get(spec)
        if compiled is not None:
            return compiled(params, caches, buffers, fed_ids, images)
        return self._step(params, caches, buffers, fed_ids, images, spec=spec)

    def prompt_logprobs(self, params: Params, hidden: Any, targets: np.ndarray) -> Any:
        compiled = self._prompt_lps.get(targets.shape[0])
        return (compiled or self._prompt_lp)(params, hidden, targets)

    def precompile(
        self, params: Params, caches: Caches, batch: PackedBatch, fed_ids: Any, images: Any = None
    ) -> None:
        buffers, spec = step_inputs(batch)
        hidden = self._precompile_step(params, caches, buffers, spec, fed_ids, images)
        if self.pooling:
            return
        targets = np.zeros(batch.token_ids.shape[0], np.int32)
        self._prompt_lps[targets.shape[0]] = self._compile(
            "prompt_logprobs",
            targets.shape[0],
            lambda: self._prompt_lp.lower(params, hidden, targets),
        )

    def _precompile_step(self, params, caches, buffers, spec, fed_ids, images) -> Any:
        """Compiles the step for ``spec``; returns its hidden states' abstract value."""
        compiled = self._compile(
            "step",
            spec,
            lambda: self._step.lower(params, caches, buffers, fed_ids, images, spec=spec),
        )
        self._steps[spec] = compiled
        return abstract_output(compiled, compiled.out_info[1], 1)

    def kv_amax(self, params: Params, caches: Caches, batch: PackedBatch, run: bool = True) -> Any:
        buffers, spec = step_inputs(batch)
        compiled = self._kv_amaxes.get(spec)
        if compiled is None:
            compiled = self._compile(
                "kv_amax", spec, lambda: self._kv_amax.lower(params, caches, buffers, spec=spec)
            )
            self._kv_amaxes[spec] = compiled
        return compiled(params, caches, buffers) if run else None

    def _compile(self, name: str, key: Any, lower) -> Any:
        return compile_ahead(self.store, name, key, lower)

    def gather(self, caches: Caches, ids: np.ndarray) -> list[np.ndarray]:
        return list(jax.device_get(self._gather(caches, ids)))

    def scatter(self, caches: Caches, ids: np.ndarray, pages: list[np.ndarray]) -> Caches:
        return self._scatter(caches, ids, tuple(pages))

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        return [list(range(len(num_tokens)))]


def single_stage(
    module: Any,
    num_layers: int,
    plan: ShardingPlan,
    module_kwargs: dict,
    k: int,
    store: ExecutableStore | None = None,
    pooling: bool = False,
    program: type[SingleStage] = SingleStage,
) -> SingleStage:
    """``module``'s program on one tensor group: its attention (``module_kwargs``:
    the attention backend's kernels) and, for a model with experts, its MoE run per
    shard by ``plan``; ``program``: `SingleStage` (FULL) or `runner.piecewise`'s."""
    kwargs = {"attention_kwargs": plan.attention_kwargs(module_kwargs)}
    if hasattr(module, "moe_kwargs"):  # (an encoder has no experts)
        kwargs["moe_kwargs"] = plan.moe_kwargs()
    return program(module.clone(**kwargs), num_layers, plan, k, store, pooling)
