"""A simple greedy decoding loop over the paged KV cache, without a scheduler.

All prompts prefill together in one ragged step, then decode one token per request per
step, through the engine's own step function (`runner.step`; on CPU its PIECEWISE
pieces, `runner.piecewise`, as a CPU engine runs them). Pages are handed out
sequentially (page 0 stays the null page). The golden model tests use it to check the
forward alone; it compiles one step per distinct token count, so it is not for serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.piecewise import Pieces, resolve_mode
from jaxengine.runner.step import make_step, step_inputs


class GreedyLoop:
    """Greedy generation for a batch of token-id prompts with one jitted step."""

    def __init__(self, module, config, params, *, page_size: int = 16) -> None:
        self.module, self.config, self.params = module, config, params
        self.page_size = page_size

        self._pieces = None
        if resolve_mode(module, None, jax.default_backend()) == "PIECEWISE":
            self._pieces = Pieces(module, None, with_logits=True)
        self._step = make_step(module)  # the engine's step function

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, return_logits: bool = False
    ):
        """Greedy continuations of ``prompts``; with ``return_logits`` also each step's
        logits per request (``[steps][R][V]`` as numpy)."""
        num_reqs = len(prompts)
        max_len = max(len(p) for p in prompts) + max_new_tokens
        pages_per_req = -(-max_len // self.page_size)
        num_pages = 1 + num_reqs * pages_per_req
        shape = kv_cache_shape(self.config, num_pages, self.page_size)
        kv_caches = tuple(jnp.zeros(shape, self.config.dtype) for _ in self.config.layers)
        pages = [
            list(range(1 + r * pages_per_req, 1 + (r + 1) * pages_per_req)) for r in range(num_reqs)
        ]
        seqs = [list(p) for p in prompts]
        computed = [0] * num_reqs
        outputs: list[list[int]] = [[] for _ in prompts]
        all_logits = []
        for _ in range(max_new_tokens):
            chunks = [
                SeqChunk(s[c:], c, pg) for s, c, pg in zip(seqs, computed, pages, strict=True)
            ]
            batch = pack_batch(
                chunks,
                page_size=self.page_size,
                num_tokens=sum(len(c.token_ids) for c in chunks),
                num_reqs=num_reqs,
                pages_per_req=pages_per_req,
            )
            buffers, spec = step_inputs(batch)
            no_feed = np.zeros(num_reqs, np.int32)
            logits, kv_caches = self._run(kv_caches, buffers, spec, no_feed)
            logits = np.asarray(logits)
            if return_logits:
                all_logits.append(logits)
            for r, token in enumerate(logits.argmax(axis=-1).tolist()):
                computed[r] = len(seqs[r])
                seqs[r].append(token)
                outputs[r].append(token)
        return (outputs, all_logits) if return_logits else outputs

    def _run(self, kv_caches, buffers, spec, no_feed):
        if self._pieces is None:
            logits, _, kv_caches = self._step(
                self.params, kv_caches, buffers, no_feed, None, spec=spec
            )
            return logits, kv_caches
        fns, buffers = self._pieces.jitted(spec), jax.device_put(buffers)
        logits, _, kv_caches = self._pieces.run(fns, self.params, kv_caches, buffers, no_feed, None)
        return logits, kv_caches
