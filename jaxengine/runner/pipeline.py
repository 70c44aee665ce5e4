"""Pipeline parallelism: the layers split into stages, each on its own tensor group.

Stage ``s`` owns layers ``layer_ranges[s]``, their KV caches and parameters (the first
stage also the embedding, the last the final norm and LM head; a tied embedding is
copied to the last stage), all placed by its own `ShardingPlan`, and one jitted
function per stage: the first maps token ids to hidden states, the middle ones
hidden states to hidden states, the last ends with the logits. A step runs the
stages in order and hands the ``[T, H]`` activations from one tensor group to the
next (`jax.device_put`, device to device). Sampling and prompt logprobs run on the
last stage. `PipelineStages` is the pipeline's `StageProgram` (`jaxengine.runner.program`):
the runner drives it exactly as it drives a single stage.

The program splits a step's requests into up to one micro-batch per stage
(`split_balanced`) and dispatches every micro-batch's stages and sampling before
reading any result. Each stage is an ordinary jitted function on its own devices and
JAX dispatches asynchronously, so stage ``s`` runs micro-batch ``m + 1`` while stage
``s + 1`` runs ``m``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxengine.runner.attention_backend import AttentionBackend
from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.program import abstract_output, zero_caches
from jaxengine.runner.step import logits_at, make_prompt_logprobs, make_swap_fns, step_inputs
from jaxengine.runner.transfer import unpack_tree
from sharding.placement import Placement


def make_stage(module: Any, layers: range, first: bool, last: bool, logits_sharding: Any):
    """``fn(params, kv_caches, x, buffers, spec)`` -> ``(out, kv_caches)`` of one stage.

    ``out`` is the hidden states ``[T, H]``, or ``(logits[R, V], hidden)`` when ``last``.
    ``x`` (the previous stage's hidden states) is ignored by the first stage.
    """

    def fn(params, kv_caches, x, buffers, spec):
        token_ids, positions, md, logits_indices, _ = unpack_tree(buffers, spec)
        hidden, kv_caches = module.apply(
            {"params": params},
            token_ids if first else x,
            positions,
            kv_caches,
            md,
            layers.start,
            layers.stop,
            first,
            last,
            method="stage",
        )
        if not last:
            return hidden, kv_caches
        logits = logits_at(module, params, hidden, logits_indices, logits_sharding)
        return (logits, hidden), kv_caches

    return jax.jit(fn, donate_argnums=(1,), static_argnames=("spec",))


def stage_params(params: dict, logical: dict, placement: Any, tie_word_embeddings: bool) -> list:
    """The parameter tree of each stage (a tied embedding copied to the last stage)."""
    trees = [{"model": {}} for _ in placement.plans]
    for key, value in params["model"].items():
        trees[placement.stage_of(("model", key))]["model"][key] = value
    for key, value in params.items():
        if key != "model":
            trees[placement.stage_of((key,))][key] = value
    last = len(trees) - 1
    if tie_word_embeddings and "embed_tokens" not in trees[last]["model"]:
        plan = placement.plans[last]
        embed = params["model"]["embed_tokens"]
        trees[last]["model"]["embed_tokens"] = jax.tree_util.tree_map(
            lambda array, spec: jax.device_put(
                array, plan.param_sharding("embed_tokens", spec, array.shape)
            ),
            embed,
            logical["model"]["embed_tokens"],
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )
    return trees


def split_balanced(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into at most ``parts`` contiguous non-empty runs whose
    sums are close to equal (each cut where the running sum passes k/parts of the total)."""
    parts = max(1, min(parts, len(sizes)))
    total, groups, current, running = sum(sizes), [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        running += size
        left_items, left_groups = len(sizes) - i - 1, parts - len(groups) - 1
        if left_groups and (
            running * parts >= total * (len(groups) + 1) or left_items == left_groups
        ):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


class PipelineStages:
    """The `StageProgram` of a pipeline: one compiled function per stage, each on its
    own tensor group; parameters and caches are per-stage lists."""

    def __init__(
        self,
        module: Any,
        placement: Placement,
        backend: AttentionBackend,
        k: int,
        logical_axes: Any,
        tie_word_embeddings: bool,
    ) -> None:
        self.placement = placement
        self._logical_axes = logical_axes
        self._tied = tie_word_embeddings
        self.plans = placement.plans
        last = len(self.plans) - 1
        self._logits_sharding = self.plans[last].replicated
        modules = [
            module.clone(
                attention_kwargs=plan.attention_kwargs(backend.module_kwargs()),
                moe_kwargs=plan.moe_kwargs(),
            )
            for plan in self.plans
        ]
        self._stages = [
            make_stage(m, layers, s == 0, s == last, self._logits_sharding)
            for s, (m, layers) in enumerate(zip(modules, placement.layer_ranges, strict=True))
        ]
        self._prompt_lp = make_prompt_logprobs(modules[last], k)
        self._gather, self._scatter = make_swap_fns()

    @property
    def logits_sharding(self) -> Any:
        return self._logits_sharding

    def place_params(self, params: Any) -> list:
        return stage_params(params, self._logical_axes, self.placement, self._tied)

    def allocate_caches(self, shape: tuple, dtype: Any) -> list:
        return [
            zero_caches(shape, dtype, len(layers), plan.kv_cache_sharding)
            for plan, layers in zip(self.plans, self.placement.layer_ranges, strict=True)
        ]

    def step(
        self, params: list, caches: list, batch: PackedBatch, fed_ids: Any
    ) -> tuple[Any, Any, list]:
        """``fed_ids`` is not read: async scheduling, which feeds sampled ids to the
        next step, is refused with pipeline parallelism (`EngineConfig`)."""
        buffers, spec = step_inputs(batch)
        x, new_caches = None, []
        for s, fn in enumerate(self._stages):
            if s:
                x = jax.device_put(x, self.plans[s].replicated)
            x, stage_caches = fn(params[s], caches[s], x, buffers, spec=spec)
            new_caches.append(stage_caches)
        logits, hidden = x
        return logits, hidden, new_caches

    def prompt_logprobs(self, params: list, hidden: Any, targets: np.ndarray) -> Any:
        return self._prompt_lp(params[-1], hidden, targets)

    def precompile(self, params: list, caches: list, batch: PackedBatch, fed_ids: Any) -> None:
        """Compiles every stage (each fed the abstract output of the one before, placed
        as `step` places it) and prompt logprobs, without running them."""
        buffers, spec = step_inputs(batch)
        x = None
        for s, fn in enumerate(self._stages):
            if s:
                x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.plans[s].replicated)
            compiled = fn.lower(params[s], caches[s], x, buffers, spec=spec).compile()
            stage = functools.partial(fn, spec=spec)
            x, _ = jax.eval_shape(stage, params[s], caches[s], x, buffers)
        hidden = abstract_output(compiled, x[1], 1)
        targets = np.zeros(batch.token_ids.shape[0], np.int32)
        self._prompt_lp.lower(params[-1], hidden, targets).compile()

    def kv_amax(self, params: list, caches: list, batch: PackedBatch, run: bool = True) -> Any:
        raise NotImplementedError(
            "--calculate-kv-scales is not supported with pipeline parallelism yet"
        )

    def gather(self, caches: list, ids: np.ndarray) -> list[np.ndarray]:
        return [page for stage in caches for page in jax.device_get(self._gather(stage, ids))]

    def scatter(self, caches: list, ids: np.ndarray, pages: list[np.ndarray]) -> list:
        out, start = [], 0
        for stage in caches:
            out.append(self._scatter(stage, ids, tuple(pages[start : start + len(stage)])))
            start += len(stage)
        return out

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        """Up to one micro-batch per stage: contiguous runs of requests with about equal
        token counts, so stage ``s`` can run micro-batch ``m + 1`` while ``s + 1`` runs ``m``."""
        return split_balanced(num_tokens, self.placement.num_stages)
