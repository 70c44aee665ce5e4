"""EAGLE proposals: a head on the target's features drafts k tokens (`models.eagle`;
the checkpoint's own multi-token-prediction layer, `models.mtp`, is such a head too).

The head runs on the target's devices with its own parameters, compiled steps and
paged KV cache (as many pages as the target's, written through the target's block
tables, like a draft model's: `speculative.device.draft`). Its input at position ``p`` is the
token at ``p + 1`` and the target's feature ``h[p]``, which exists only in the step
that computed ``p``. So after each target step, for each request of the step:

1. catch up: one pass over the positions the target computed and kept (its accepted
   tokens; a prefill chunk's positions), each with the token after it (the next
   prompt token, or the token just sampled) and the target's feature from the step's
   hidden states, in the target step's own bucket; the row of a proposing request's
   last kept position gives its first draft. This pass runs for every step, proposals
   or not (``disable_by_batch_size``), so the head's KV never misses a position;
2. then k - 1 one-token passes over the proposing requests, each feeding the
   previous draft and the head's own feature of the position before.

Drafts are greedy (argmax of the target's LM head on the head's feature), so each
proposal's distribution is one-hot and the verification keeps the target's
distribution exact. The head's KV of positions past a request's kept tokens is
rewritten by the catch-up of the step that computes them. A swapped-in request's
head KV is not restored: its drafts are worse until those pages are computed again,
the outputs are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.buckets import Bucket, BucketSet
from jaxengine.runner.program import abstract_like, delete_arrays, zero_caches
from jaxengine.runner.step import step_inputs
from jaxengine.runner.transfer import unpack_tree
from jaxengine.speculative import ProposalInput, StepFeatures
from jaxengine.speculative.device.draft import DraftSettings


def make_eagle_step(head: Any, target: Any, max_num_seqs: int, shared_embedding: bool):
    """``step(head_params, target_params, kv_caches, buffers, source, spec)`` ->
    ``(ids[R], features[max_num_seqs, H], kv)``.

    ``buffers``/``spec`` pack a `PackedBatch` whose ``feed_rows`` give each token's row
    of ``source`` (the target's hidden states, or the previous pass's features); the
    head's feature at each logits row gives that row's draft (argmax of the target's
    LM head on the head's ``logits_input`` of it: an MTP layer's shared-head norm) and
    its feature, padded to ``max_num_seqs`` rows so the next pass's source has one
    shape whatever the bucket. ``shared_embedding``: the head reads the target's
    embedding (its checkpoint has none)."""

    def step(head_params, target_params, kv_caches, buffers, source, spec):
        token_ids, positions, md, logits_indices, src_rows = unpack_tree(buffers, spec)
        if shared_embedding:
            embed = target_params["model"]["embed_tokens"]
            head_params = {"model": {**head_params["model"], "embed_tokens": embed}}
        out, kv_caches = head.apply(
            {"params": head_params}, token_ids, positions, source[src_rows], kv_caches, md
        )
        feats = out[logits_indices]
        normed = head.apply({"params": head_params}, feats, method="logits_input")
        logits = target.apply({"params": target_params}, normed, method="compute_logits")
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        padded = jnp.zeros((max_num_seqs, feats.shape[1]), feats.dtype)
        return ids, padded.at[: feats.shape[0]].set(feats), kv_caches

    return jax.jit(step, donate_argnums=(2,), static_argnames=("spec",))


class EagleProposer:
    """The EAGLE head of one runner: its parameters, KV cache and compiled steps."""

    def __init__(
        self,
        step: Any,
        params: Any,
        settings: DraftSettings,
        num_layers: int,
        source: jax.ShapeDtypeStruct,
        target_shapes: Any,
        cache_sharding: Any = None,
    ) -> None:
        """``step``: `make_eagle_step`'s; ``source``: one row of the target's hidden
        states (dtype, and sharding if any) and ``target_shapes`` the target's
        parameters as shapes (`abstract_like`), for compiling ahead."""
        self.step, self.params, self.settings = step, params, settings
        self.target_shapes = target_shapes
        shape = (settings.num_blocks, *settings.cache_page_shape)
        self.caches = zero_caches(shape, settings.cache_dtype, num_layers, cache_sharding)
        self.buckets = BucketSet(list(settings.token_buckets), settings.max_num_seqs)
        self.source = source
        self._compiled: dict[tuple, Any] = {}  # (batch spec, source rows) -> executable

    # ------------------------------------------------------------------ warm-up

    def compile_jobs(self) -> list[tuple[tuple, Callable[[], None]]]:
        """(key, job): the catch-up per bucket (its source the target step's hidden
        states of that bucket), then the one-token passes' buckets (their source
        the previous pass's features)."""
        n = self.settings.max_num_seqs
        jobs = {(b, b.num_tokens) for b in self.buckets.buckets}
        last = self.buckets.select(n, n)
        if self.settings.k > 1:  # (k = 1: the catch-up's drafts are all)
            jobs |= {(b, n) for b in self.buckets.buckets if b.num_tokens <= last.num_tokens}
        return [
            (("eagle", b, rows), lambda b=b, rows=rows: self._warm(b, rows))
            for b, rows in sorted(jobs, key=lambda x: (x[0].num_tokens, x[1]))
        ]

    def _warm(self, bucket: Bucket, rows: int) -> None:
        self._executable(self._pack([], [], bucket), rows, target_params=None)

    def _executable(self, batch, rows: int, target_params: Any) -> Any:
        """The compiled step for ``batch``'s shapes and a source of ``rows`` rows
        (compiled here at warm-up, where ``target_params`` is None)."""
        buffers, spec = step_inputs(batch)
        key = (spec, rows)
        if key not in self._compiled and target_params is None:
            source = jax.ShapeDtypeStruct(
                (rows, self.source.shape[1]), self.source.dtype, sharding=self.source.sharding
            )
            lowered = self.step.lower(
                self.params, self.target_shapes, abstract_like(self.caches), buffers, source,
                spec=spec,
            )  # fmt: skip
            self._compiled[key] = lowered.compile()
        return self._compiled.get(key), buffers, spec

    # ------------------------------------------------------------------ proposals

    def forget(self, req_ids: Any) -> None:
        """Nothing to drop: the head keeps no state per request."""

    def propose(
        self,
        inputs: Sequence[ProposalInput],
        features: StepFeatures | None,
        ensure: Callable[[tuple], None],
    ) -> list[list[int]]:
        none: list[list[int]] = [[] for _ in inputs]
        if features is None or not inputs:
            return none
        drafts, feats, rows = self._catch_up(inputs, features, ensure)
        limit = self.settings.disable_by_batch_size
        if limit is not None and len(inputs) >= limit:
            return none
        rooms = {i: self._room(inputs[i]) for i in drafts}
        drafts = {i: ids for i, ids in drafts.items() if rooms[i] > 0}
        for j in range(1, self.settings.k):
            active = [i for i in drafts if rooms[i] > j]
            if not active:
                break
            x = [inputs[i] for i in active]
            chunks = [
                SeqChunk([drafts[i][-1]], len(y.token_ids) + j - 2, y.pages)
                for i, y in zip(active, x, strict=True)
            ]
            bucket = self.buckets.select(len(chunks), len(chunks))
            src = [rows[i] for i in active]
            ids, feats = self._run(chunks, src, feats, bucket, features.params, ensure)
            rows = {i: r for r, i in enumerate(active)}
            for r, i in enumerate(active):
                drafts[i].append(int(ids[r]))
        return [drafts.get(i, []) for i in range(len(inputs))]

    def _room(self, x: ProposalInput) -> int:
        """Drafts the request's pages have room for: draft j reads position
        ``len(tokens) + j - 2``; none unless it proposes."""
        if not x.propose:
            return 0
        return min(self.settings.k, len(x.pages) * self.settings.block_size - len(x.token_ids) + 1)

    def _catch_up(self, inputs: Sequence[ProposalInput], features: StepFeatures, ensure):
        """The pass over every request's kept positions of the step; returns the first
        draft by request index, the features and each request's row in them."""
        chunks, src, index = [], [], []
        for i, x in enumerate(inputs):
            end = min(x.num_computed, len(x.token_ids) - 1)
            if end <= x.start:
                continue
            chunks.append(SeqChunk(list(x.token_ids[x.start + 1 : end + 1]), x.start, x.pages))
            src.extend(range(x.row, x.row + end - x.start))
            index.append(i)
        if not chunks:
            return {}, None, {}
        bucket = self.buckets.select(features.hidden.shape[0], len(chunks))
        ids, feats = self._run(chunks, src, features.hidden, bucket, features.params, ensure)
        drafts = {i: [int(ids[r])] for r, i in enumerate(index)}
        return drafts, feats, {i: r for r, i in enumerate(index)}

    def _run(self, chunks, src: list[int], source, bucket: Bucket, target_params, ensure):
        """One head pass in ``bucket``, token ``i`` reading row ``src[i]`` of
        ``source``; (draft per chunk on the host, features on device)."""
        rows = source.shape[0]
        ensure(("eagle", bucket, rows))
        batch = self._pack(chunks, src, bucket)
        compiled, buffers, spec = self._executable(batch, rows, target_params)
        args = (self.params, target_params, self.caches, buffers, source)
        if compiled is None:
            ids, feats, self.caches = self.step(*args, spec=spec)
        else:
            ids, feats, self.caches = compiled(*args)
        return np.asarray(jax.device_get(ids)), feats

    def _pack(self, chunks: list[SeqChunk], src: list[int], bucket: Bucket):
        s = self.settings
        batch = pack_batch(
            chunks,
            page_size=s.block_size,
            num_tokens=bucket.num_tokens,
            num_reqs=bucket.num_reqs,
            pages_per_req=s.pages_per_req,
        )
        batch.feed_rows[:] = 0
        batch.feed_rows[: len(src)] = src
        return batch

    def release(self) -> None:
        delete_arrays((self.params, self.caches))
        self.params = self.caches = None
