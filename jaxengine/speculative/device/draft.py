"""Draft-model proposals: a smaller model of the same vocabulary drafts k tokens.

The draft model runs on the target's devices as its own stage program, with its own
parameters, its own compiled steps (the target's token buckets, one logits row per
request) and its own paged KV cache of as many pages as the target's. It uses the
target's block tables: a request's position p has its draft KV in the same page and
slot as its target KV. The scheduler allocates ``k`` lookahead slots beyond each
step's tokens, so the pages the draft writes its proposals' KV into exist.

After each target step, for each request of the step (`DraftProposer.propose`):

1. catch up: run the draft over the request's tokens whose draft KV is missing or
   stale (a new request's prompt chunk, the proposals just accepted, and for a
   proposing request its newest token), in passes no larger than the largest
   bucket; the logits of a proposing request's newest token give its first draft;
2. then k - 1 one-token passes over the proposing requests, each feeding the
   previous draft (greedy: argmax of the draft's logits).

Drafts are greedy, so each proposal's distribution is one-hot and the target's
verification (`speculative.verify`) keeps its distribution exact. A request's
draft KV is valid below ``computed[req]``: after a step that accepted ``a`` of its
proposals it is valid up to the first rejected one, which the next catch-up rewrites.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.buckets import Bucket, BucketSet
from jaxengine.runner.program import StageProgram, abstract_like, delete_arrays
from jaxengine.speculative import ProposalInput, StepFeatures


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    k: int  # proposals per request and step
    block_size: int
    num_blocks: int
    pages_per_req: int
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    vocab_size: int
    cache_page_shape: tuple[int, ...]  # one draft layer's page
    cache_dtype: Any
    disable_by_batch_size: int | None = None  # no proposals for steps this large


@dataclasses.dataclass
class _Piece:
    """Part of one request's catch-up in one pass."""

    index: int  # the request's index among the inputs
    chunk: SeqChunk
    last: bool  # ends at the request's newest token


class DraftProposer:
    """The draft model of one runner: its parameters, KV cache and compiled steps."""

    def __init__(self, program: StageProgram, params: Any, settings: DraftSettings) -> None:
        self.program, self.settings = program, settings
        self.params = program.place_params(params)
        shape = (settings.num_blocks, *settings.cache_page_shape)
        self.caches = program.allocate_caches(shape, settings.cache_dtype)
        self.buckets = BucketSet(list(settings.token_buckets), settings.max_num_seqs)
        self.no_feed = jnp.zeros(settings.max_num_seqs, jnp.int32)
        self._argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
        self._argmaxes: dict[int, Any] = {}  # rows -> compiled argmax
        self.computed: dict[str, int] = {}  # request -> positions with valid draft KV

    # ------------------------------------------------------------------ warm-up

    def compile_jobs(self) -> list[tuple[tuple, Callable[[], None]]]:
        """(key, job) per bucket: the draft step and its argmax, compiled ahead."""
        return [(("draft", b), lambda b=b: self._warm(b)) for b in self.buckets.buckets]

    def _warm(self, bucket: Bucket) -> None:
        batch = self._pack([], bucket)
        caches = abstract_like(self.caches)
        self.program.precompile(self.params, caches, batch, abstract_like(self.no_feed))
        if bucket.num_reqs not in self._argmaxes:
            logits = jax.ShapeDtypeStruct((bucket.num_reqs, self.settings.vocab_size), jnp.float32)
            sharding = self.program.logits_sharding
            if sharding is not None:
                logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=sharding)
            self._argmaxes[bucket.num_reqs] = self._argmax.lower(logits).compile()

    # ------------------------------------------------------------------ proposals

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.computed.pop(req_id, None)

    def propose(
        self,
        inputs: Sequence[ProposalInput],
        features: StepFeatures | None,
        ensure: Callable[[tuple], None],
    ) -> list[list[int]]:
        limit = self.settings.disable_by_batch_size
        if limit is not None and len(inputs) >= limit:  # (catch-up comes later)
            return [[] for _ in inputs]
        drafts = self._catch_up(inputs, ensure)
        rooms = {i: self._room(inputs[i]) for i in drafts}
        for j in range(1, self.settings.k):
            active = [i for i in drafts if rooms[i] > j]
            if not active:
                break
            pieces = [self._next_piece(inputs[i], i, drafts[i], j) for i in active]
            for i, token in self._run(pieces, ensure).items():
                drafts[i].append(token)
        for i, ids in drafts.items():
            self.computed[inputs[i].req_id] = len(inputs[i].token_ids) + len(ids) - 1
        return [drafts.get(i, []) for i in range(len(inputs))]

    def _room(self, x: ProposalInput) -> int:
        """Drafts the request's pages have room for: draft j reads position
        ``len(tokens) + j - 2``."""
        return min(self.settings.k, len(x.pages) * self.settings.block_size - len(x.token_ids) + 1)

    def _next_piece(self, x: ProposalInput, i: int, ids: list[int], j: int) -> _Piece:
        chunk = SeqChunk([ids[-1]], len(x.token_ids) + j - 1, x.pages)
        return _Piece(i, chunk, True)

    def _catch_up(self, inputs: Sequence[ProposalInput], ensure) -> dict[int, list[int]]:
        """Runs the draft over every request's stale positions; returns the first
        draft of each proposing request."""
        pieces = []
        for i, x in enumerate(inputs):
            room = len(x.pages) * self.settings.block_size  # (at max_model_len: full)
            propose = x.propose and len(x.token_ids) <= room
            end = len(x.token_ids) if propose else min(x.num_computed, room)
            start = min(self.computed.get(x.req_id, 0), end - 1 if propose else end)
            self.computed[x.req_id] = end
            if end > start:
                chunk = SeqChunk(x.token_ids[start:end], start, x.pages)
                pieces.append(_Piece(i, chunk, propose))
        drafts: dict[int, list[int]] = {}
        for group in self._passes(pieces):
            drafts.update({i: [t] for i, t in self._run(group, ensure).items()})
        return drafts

    def _passes(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        """Pieces split and grouped so each pass fits the largest bucket."""
        largest = self.buckets.buckets[-1]
        passes, current, used = [], [], 0
        for piece in pieces:
            ids, start = list(piece.chunk.token_ids), piece.chunk.num_computed
            while ids:
                if used == largest.num_tokens or len(current) == largest.num_reqs:
                    passes.append(current)
                    current, used = [], 0
                take = min(len(ids), largest.num_tokens - used)
                chunk = SeqChunk(ids[:take], start, piece.chunk.page_ids)
                current.append(_Piece(piece.index, chunk, piece.last and take == len(ids)))
                ids, start, used = ids[take:], start + take, used + take
        return passes + ([current] if current else [])

    def _run(self, pieces: list[_Piece], ensure: Callable[[tuple], None]) -> dict[int, int]:
        """One draft pass; the argmax after each piece that ends a proposing
        request's tokens, by request index."""
        chunks = [p.chunk for p in pieces]
        bucket = self.buckets.select(sum(len(c.token_ids) for c in chunks), len(chunks))
        ensure(("draft", bucket))
        batch = self._pack(chunks, bucket)
        logits, _, self.caches = self.program.step(self.params, self.caches, batch, self.no_feed)
        if not any(p.last for p in pieces):
            return {}
        argmax = self._argmaxes.get(bucket.num_reqs, self._argmax)
        ids = np.asarray(jax.device_get(argmax(logits)))
        return {p.index: int(ids[r]) for r, p in enumerate(pieces) if p.last}

    def _pack(self, chunks: list[SeqChunk], bucket: Bucket):
        s = self.settings
        return pack_batch(
            chunks,
            page_size=s.block_size,
            num_tokens=bucket.num_tokens,
            num_reqs=bucket.num_reqs,
            pages_per_req=s.pages_per_req,
        )

    def release(self) -> None:
        delete_arrays((self.params, self.caches))
        self.params = self.caches = None
