"""The step compiled in pieces (``--cudagraph-mode PIECEWISE``, the default on CPU).

A FULL step is one XLA program per bucket with every decoder layer inlined: XLA's
passes walk thirty copies of the layer for a 30-layer model, seconds of compilation
per bucket on a CPU. A PIECEWISE step is, per bucket, three kinds of program:

- ``embed``: the fed token ids (async scheduling), the embedding and image rows;
- ``layer``: one decoder layer with its own parameters and KV cache (donated), one
  program per kind of layer (`models.layers.decoder.layer_kind`: one for a Llama,
  two for Gemma 3's sliding and full layers), called once per layer;
- ``head``: the final norm and the logits of the sampled rows.

The host calls them in order; JAX dispatches asynchronously, so the device runs the
step back to back while the host goes on. The arithmetic is the layer's own
(`run_layers`' shared body, the same precision), so a PIECEWISE step gives the tokens
a FULL step gives. The hidden states between pieces are pinned replicated on a tensor
group, as the layers leave them.

`PiecewiseStage` is a `SingleStage` (`runner.program`) whose step and precompilation
are the pieces'; prompt logprobs, swaps and the KV-scale pass are the same.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxengine.models.layers.basic import matmul_precision
from jaxengine.models.layers.decoder import CausalLM, SequenceClassifier, layer_kind
from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.program import Caches, Params, SingleStage, abstract_output
from jaxengine.runner.step import fed_token_ids, image_embeds, logits_at, step_inputs
from jaxengine.runner.transfer import unpack_tree


def supports_pieces(module: Any) -> bool:
    """Whether ``module``'s forward is a decoder stack the pieces can run."""
    return isinstance(module, CausalLM | SequenceClassifier)


def _stage(module, *args):
    return module.model.stage(*args)


class Pieces:
    """The jitted pieces of one model's step (unbound: ``spec`` static)."""

    def __init__(self, module: Any, pinned: Any, with_logits: bool) -> None:
        layers = module.bind({"params": {}}).model.layers
        kinds = [layer_kind(layer) for layer in layers]
        unique = list(dict.fromkeys(kinds))  # in order of first use
        self.kind_of = [unique.index(kind) for kind in kinds]  # layer -> its kind's index
        templates = [layers[kinds.index(kind)].clone(parent=None) for kind in unique]
        self.embed = jax.jit(functools.partial(self._embed, module, pinned), static_argnames="spec")
        self.layers = [
            jax.jit(
                functools.partial(self._layer, template, pinned),
                donate_argnums=(2,),
                static_argnames="spec",
            )
            for template in templates
        ]
        head = functools.partial(self._head, module, len(layers), pinned, with_logits)
        self.head = jax.jit(head, static_argnames="spec")

    def jitted(self, spec: Any) -> tuple:
        """``(embed, [layer per kind], head)`` of a bucket, as `run` calls them."""
        p = functools.partial
        kinds = [p(layer, spec=spec) for layer in self.layers]
        return p(self.embed, spec=spec), kinds, p(self.head, spec=spec)

    def run(self, fns: tuple, params, caches, buffers, fed_ids, images) -> tuple:
        """A step through ``fns`` (`jitted`'s, or their executables): ``(logits,
        hidden, caches)`` as `runner.step.make_step`'s function returns them."""
        embed, kinds, head = fns
        outer = outer_params(params)
        x = embed(outer, buffers, fed_ids, images)
        new_caches = []
        for i, cache in enumerate(caches):
            x, cache = kinds[self.kind_of[i]](layer_variables(params, i), x, cache, buffers)
            new_caches.append(cache)
        logits, hidden = head(outer, x, buffers)
        return logits, hidden, tuple(new_caches)

    @staticmethod
    def _embed(module, pinned, outer, buffers, fed_ids, images, spec):
        token_ids, positions, md, _, feed_rows = unpack_tree(buffers, spec)
        token_ids = fed_token_ids(token_ids, feed_rows, fed_ids)
        embeds = None if images is None else image_embeds(images, md)
        args = (token_ids, positions, (), md, 0, 0, True, False, embeds)
        x, _ = module.apply({"params": outer}, *args, method=_stage)
        return _pin(x, pinned)

    @staticmethod
    def _layer(template, pinned, variables, x, kv_cache, buffers, spec):
        _, positions, md, _, _ = unpack_tree(buffers, spec)
        with matmul_precision(template.config):
            x, kv_cache = template.apply(variables, x, positions, kv_cache, md)
        return _pin(x, pinned), kv_cache

    @staticmethod
    def _head(module, num_layers, pinned, with_logits, outer, x, buffers, spec):
        _, positions, md, logits_indices, _ = unpack_tree(buffers, spec)
        args = (x, positions, (), md, num_layers, num_layers, False, True)
        hidden, _ = module.apply({"params": outer}, *args, method=_stage)
        if not with_logits:
            return None, hidden
        return logits_at(module, outer, hidden, logits_indices, pinned), hidden


def _pin(x: jax.Array, sharding: Any) -> jax.Array:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def outer_params(params: Params) -> Params:
    """The parameters outside the decoder layers (embedding, final norm, head)."""
    model = {k: v for k, v in params["model"].items() if not k.startswith("layers_")}
    return {**params, "model": model}


def layer_variables(params: Params, i: int) -> dict:
    return {"params": params["model"][f"layers_{i}"]}


class PiecewiseStage(SingleStage):
    """A `SingleStage` whose step runs as `Pieces`: per bucket, the embedding, each
    kind of layer and the head compiled apart (stored apart in the executable store,
    as ``step.embed``, ``step.layer<kind>``, ``step.head``)."""

    def __init__(self, module: Any, num_layers: int, plan: Any, k: int, store=None, pooling=False):
        super().__init__(module, num_layers, plan, k, store, pooling)
        self._pieces = Pieces(module, self._logits_sharding, not pooling)
        self._placed = None if plan is None else plan.replicated
        self._compiled: dict[Any, tuple] = {}  # batch spec -> (embed, [layer per kind], head)

    def step(
        self, params: Params, caches: Caches, batch: PackedBatch, fed_ids: Any, images: Any = None
    ) -> tuple[Any, Any, Caches]:
        buffers, spec = step_inputs(batch)
        buffers = jax.device_put(buffers, self._placed)  # once, not once per piece
        fns = self._compiled.get(spec) or self._pieces.jitted(spec)
        return self._pieces.run(fns, params, caches, buffers, fed_ids, images)

    def _precompile_step(self, params, caches, buffers, spec, fed_ids, images) -> Any:
        pieces = self._pieces
        buffers = jax.device_put(buffers, self._placed)
        outer = outer_params(params)
        lower = functools.partial(pieces.embed.lower, outer, buffers, fed_ids, images)
        embed = self._compile("step.embed", spec, lambda: lower(spec=spec))
        x = abstract_output(embed, embed.out_info, 0)
        kinds = []
        for kind, fn in enumerate(pieces.layers):
            i = pieces.kind_of.index(kind)  # the first layer of this kind
            lower = functools.partial(fn.lower, layer_variables(params, i), x, caches[i], buffers)
            kinds.append(self._compile(f"step.layer{kind}", spec, lambda f=lower: f(spec=spec)))
        head = self._compile(
            "step.head", spec, lambda: pieces.head.lower(outer, x, buffers, spec=spec)
        )
        self._compiled[spec] = (embed, kinds, head)
        if self.pooling:
            return None
        return abstract_output(head, head.out_info[1], 1)


def program_class(module: Any, mode: str | None, plan: Any) -> type[SingleStage]:
    """The program of a single stage of ``module`` under ``cudagraph_mode`` ``mode``
    on ``plan``'s devices (`resolve_mode`)."""
    mode = resolve_mode(module, mode, plan.devices[0].platform)
    return PiecewiseStage if mode == "PIECEWISE" else SingleStage


def resolve_mode(module: Any, mode: str | None, platform: str) -> str:
    """``cudagraph_mode`` for ``module`` on ``platform``: ``mode``, or when None
    PIECEWISE on CPU where the model supports it, else FULL."""
    if mode is None:
        return "PIECEWISE" if platform == "cpu" and supports_pieces(module) else "FULL"
    if mode == "PIECEWISE" and not supports_pieces(module):
        name = type(module).__name__
        raise ValueError(f"cudagraph_mode PIECEWISE is not supported for {name}; use FULL")
    return mode
