"""Pipeline parallelism: the layers split into stages, each on its own tensor group.

Stage ``s`` owns layers ``layer_ranges[s]``, their KV caches and parameters (the first
stage also the embedding, the last the final norm and LM head; a tied embedding is
copied to the last stage), all placed by its own `ShardingPlan`, and one jitted
function per stage: the first maps token ids to hidden states, the middle ones
hidden states to hidden states, the last ends with the logits. A step runs the
stages in order and hands the ``[T, H]`` activations from one tensor group to the
next (`jax.device_put`, device to device). Sampling and prompt logprobs run on the
last stage.

The runner splits a step's requests into up to one micro-batch per stage
(`split_balanced`) and dispatches every micro-batch's stages and sampling before
reading any result. Each stage is an ordinary jitted function on its own devices and
JAX dispatches asynchronously, so stage ``s`` runs micro-batch ``m + 1`` while stage
``s + 1`` runs ``m``.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxengine.runner.compiled import CompiledFunctions
from jaxengine.runner.model_runner import ModelRunner
from jaxengine.runner.step import step_inputs
from jaxengine.runner.transfer import unpack_tree


def make_stage(module: Any, layers: range, first: bool, last: bool, logits_sharding: Any):
    """``fn(params, kv_caches, x, buffers, spec)`` -> ``(out, kv_caches)`` of one stage.

    ``out`` is the hidden states ``[T, H]``, or ``(logits[R, V], hidden)`` when ``last``.
    ``x`` (the previous stage's hidden states) is ignored by the first stage.
    """

    def fn(params, kv_caches, x, buffers, spec):
        token_ids, positions, md, logits_indices = unpack_tree(buffers, spec)
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
        logits = module.apply({"params": params}, hidden[logits_indices], method="compute_logits")
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
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


class PipelineCompiled(CompiledFunctions):
    """`CompiledFunctions` whose step runs the stages in turn; params and caches are
    per-stage lists."""

    def __init__(self, runner: PipelineRunner) -> None:
        super().__init__(runner)
        placement, last = runner.placement, len(runner.stage_modules) - 1
        self._stages = [
            make_stage(module, layers, s == 0, s == last, self.logits_sharding)
            for s, (module, layers) in enumerate(
                zip(runner.stage_modules, placement.layer_ranges, strict=True)
            )
        ]

    def step(self, params, kv_caches, batch):
        buffers, spec = step_inputs(batch)
        plans = self.runner.placement.plans
        x, new_caches = None, []
        for s, fn in enumerate(self._stages):
            if s:
                x = jax.device_put(x, plans[s].replicated)
            x, caches = fn(params[s], kv_caches[s], x, buffers, spec=spec)
            new_caches.append(caches)
        logits, hidden = x
        return logits, hidden, new_caches

    def prompt_logprobs(self, params, hidden, targets):
        return super().prompt_logprobs(params[-1], hidden, targets)

    def gather_pages(self, kv_caches, ids):
        gather = super().gather_pages
        return [page for caches in kv_caches for page in gather(caches, ids)]

    def scatter_pages(self, kv_caches, ids, pages):
        out, start = [], 0
        for caches in kv_caches:
            out.append(super().scatter_pages(caches, ids, pages[start : start + len(caches)]))
            start += len(caches)
        return out


class PipelineRunner(ModelRunner):
    """A `ModelRunner` whose layers, caches and parameters are split into stages."""

    def __init__(self, loaded: Any, settings: Any, placement: Any, backend: Any) -> None:
        self.placement = placement
        self.stage_modules = [
            loaded.module.clone(
                attention_kwargs=plan.attention_kwargs(backend.module_kwargs()),
                moe_kwargs=plan.moe_kwargs(),
            )
            for plan in placement.plans
        ]
        super().__init__(loaded, settings, placement.plans[-1])
        self.params = stage_params(
            loaded.params, loaded.logical_axes, placement, loaded.config.tie_word_embeddings
        )

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        """Up to one micro-batch per stage: contiguous runs of requests with about equal
        token counts, so stage ``s`` can run micro-batch ``m + 1`` while ``s + 1`` runs ``m``."""
        return split_balanced(num_tokens, self.placement.num_stages)

    def _allocate_kv_caches(self, shape: tuple, dtype: Any, num_layers: int) -> Any:
        def zeros(count: int, sharding: Any):
            make = jax.jit(
                lambda: tuple(jax.numpy.zeros(shape, dtype) for _ in range(count)),
                out_shardings=(sharding,) * count,
            )
            return make()

        return [
            zeros(len(layers), plan.kv_cache_sharding)
            for plan, layers in zip(self.placement.plans, self.placement.layer_ranges, strict=True)
        ]

    def _compiled_functions(self) -> CompiledFunctions:
        return PipelineCompiled(self)
