"""The device side of one engine: host batch state, a stage program and the sampler.

`ModelRunner.execute(SchedulerOutput) -> RunnerOutput` (the contract in
`jaxengine.core.sched_output`), or `launch(SchedulerOutput) -> PendingStep` and later
`PendingStep.result()`: it updates its persistent request table
(`runner.request_table`), copies swapped pages (`runner.swap`), packs the scheduled
tokens into the smallest bucket (`runner.batch`, `runner.buckets`), runs the stage
program's compiled step (forward, KV write, last-token logits: `runner.program`)
and the compiled sampler variant that covers the batch (`runner.sampler_functions`),
and returns only sampled ids and requested logprobs to the host.

The runner is composed of those parts; none of them refers back to it. It owns the
device buffers (parameters and KV caches): every compiled call takes them and
returns the updated caches. `release()` deletes them.

Async scheduling: `launch` dispatches a step and returns without reading anything
back, so the host can schedule and launch the next one while the device computes.
A request whose previous token is still being sampled (by the step launched just
before, not yet collected) has that position's id fed on device: its packed token
points (``feed_rows``) into the previous step's sampled ids, which the sampler
leaves padded to ``max_num_seqs``. Its sampling row counts that token (random
draws and ``min_tokens`` see the right position). At most one step is in flight:
each `PendingStep.result()` comes before the launch after next.

The model step and the sampler are two compiled functions, not one: fusing them would
multiply the compile count by the number of sampler variants. Logits stay on device
between them. Per-request `logits_processors` (host callables) take a slower path:
the logits come to the host, the processors run, and the logits go back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.runner.batch import PackedBatch, SeqChunk, pack_batch
from jaxengine.runner.buckets import Bucket, BucketSet
from jaxengine.runner.compile_guard import CompileGuard
from jaxengine.runner.encoder import EncoderRunner
from jaxengine.runner.kv_scales import with_kv_scales
from jaxengine.runner.logprobs import prompt_logprobs
from jaxengine.runner.lora_slots import LoRASlots
from jaxengine.runner.pending import Feed, Launched, PendingStep
from jaxengine.runner.pooled import classifier_heads, padded_logits, pooled_output
from jaxengine.runner.program import (
    Caches,
    Params,
    StageProgram,
    abstract_like,
    delete_arrays,
)
from jaxengine.runner.request_table import RequestState, RequestTable
from jaxengine.runner.sampler_functions import SamplerFunctions
from jaxengine.runner.sampling_metadata import (
    SamplingBatch,
    apply_logits_processors,
    pick_variant,
    step_sampling_rows,
)
from jaxengine.runner.settings import RunnerSettings
from jaxengine.runner.state_swap import HostStates
from jaxengine.runner.states import make_caches, slot_pairs, state_copier
from jaxengine.runner.swap import HostSwapSpace
from jaxengine.runner.warmup import CompileJobs
from jaxengine.runner.weights import WeightLayout
from jaxengine.speculative import ProposalInput, Proposer, StepFeatures

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduled steps of one model on its devices."""

    def __init__(
        self,
        program: StageProgram,
        params: Params,
        settings: RunnerSettings,
        sampler: SamplerFunctions,
        lora: LoRASlots | None = None,
        proposer: Proposer | None = None,
        classifier: Callable[[Params, np.ndarray], jax.Array] | None = None,
        weights: WeightLayout | None = None,
        encoder: EncoderRunner | None = None,
        abstract: bool = False,
    ) -> None:
        """``lora``: the adapter slots (``--enable-lora``), None without LoRA.
        ``proposer``: speculative decoding's (``--speculative-config``), or None.
        ``classifier``: a classification model's head (`step.make_classifier`).
        ``weights``: how checkpoint names map onto ``params`` (`update_weights`;
        None: the model takes no updates, the transformers fallback).
        ``encoder``: a vision-language model's image encoder step (`runner.encoder`).
        ``abstract``: a compile-only runner (``jaxengine tpu-check``): ``params`` are
        placed shapes, the caches too, nothing is allocated or run; `warmup` compiles
        every start-up program and `step` is never called."""
        self.encoder = encoder
        self.classifier = classifier
        self.weights = weights
        self.program = program
        self.lora = lora
        self.proposer = proposer
        self.settings = settings
        self.sampler = sampler
        self.params = program.place_params(params)
        self.buckets = BucketSet(
            list(settings.token_buckets), settings.max_num_seqs, 1 + settings.num_speculative_tokens
        )
        self.abstract = abstract
        self.kv_caches: Caches = make_caches(program, settings, abstract)  # (`runner.states`)
        self.swap = None
        if settings.num_host_blocks and not abstract:  # (its copies run at warm-up)
            self.swap = HostSwapSpace(
                settings.cache_page_shape,
                settings.cache_dtype,
                settings.num_paged_layers,
                settings.num_host_blocks,
                chunk=settings.pages_per_req,
                num_device_blocks=settings.num_blocks,
            )
        slots = settings.max_num_seqs if settings.state_shapes else 0  # hybrid models' states
        self.table = RequestTable(settings.pages_per_req, settings.seed, state_slots=slots)
        self.state_copier = state_copier(settings)  # saved states' copies (prefix caching)
        swapped = self.swap is not None and settings.state_shapes is not None
        self.host_states = HostStates() if swapped else None  # swapped requests' states
        self._feed: Feed | None = None
        # the ``fed_ids`` of a step with no token in flight
        zeros = np.zeros(settings.num_sample_slots, np.int32)
        self.no_feed = sampler.feed_shape() if abstract else sampler.to_device(zeros)
        self.calibrate_kv = settings.calculate_kv_scales  # until the first step
        self.guard = CompileGuard()
        self.compiles = CompileJobs(())  # none until `warmup` (``--enforce-eager``: never)

    @property
    def pages_per_req(self) -> int:
        return self.settings.pages_per_req

    # ------------------------------------------------------------------ warm-up

    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compiles every bucket's step and prompt-logprobs function and every sampler
        variant at every request count ahead of time (lowered and compiled, or loaded
        from the executable store; not run: a large bucket's forward costs seconds on
        CPU, and the steps call these executables), then arms the compile guard.

        ``background``: returns after the swap copies; a thread compiles the rest,
        smallest buckets first, while steps compile what they need first
        (`runner.warmup`). The guard arms when the thread is done."""
        if self.swap is not None:
            with self.guard.watching():
                self._warm_swap()  # replaces the caches: never beside a step
        self.compiles = CompileJobs(
            self._compile_jobs(), on_done=self._warmed, context=self.guard.watching
        )
        if background:
            logger.info(
                "compiling %d buckets and %d sampler variants in the background; a step "
                "compiles what it needs first",
                len(self.buckets.buckets),
                len(self.sampler.variants) * len(self.buckets.logits_sizes),
            )
            self.compiles.start()
            return
        with self.guard.watching():
            self.compiles.run_all(progress)

    def _compile_jobs(self) -> list:
        """(key, job) per bucket step and per sampler variant at its request count,
        in the order traffic meets them: small batches first, greedy first."""
        caches = abstract_like(self.kv_caches)  # the real ones are donated by each step
        jobs, sizes = [], set()
        if self.lora is not None:
            jobs.append((("lora_write",), lambda: self.lora.precompile(self.params)))
        if self.proposer is not None:
            jobs += self.proposer.compile_jobs()
        if self.encoder is not None:
            jobs += self.encoder.compile_jobs()
        if self.classifier is not None:
            jobs.append((("classify",), lambda: self._classify(np.zeros((1, 1), np.float32))))
        if self.state_copier is not None:
            jobs.append((("state_copy",), lambda: self.state_copier.precompile(caches)))
        if self.calibrate_kv:
            largest = self.buckets.buckets[-1]
            batch = self._pack([], largest)
            jobs.append(
                (("kv_amax",), lambda: self.program.kv_amax(self.params, caches, batch, False))
            )
        for bucket in self.buckets.buckets:
            jobs.append((("step", bucket), lambda b=bucket: self._warm_bucket(b, caches)))
            if bucket.num_logits not in sizes and self.settings.pooler is None:
                sizes.add(bucket.num_logits)
                jobs += [
                    (("sample", bucket.num_logits, f), self._sampler_job(bucket.num_logits, f))
                    for f in self.sampler.variants
                ]
        return jobs

    def _sampler_job(self, num_reqs: int, flags):
        return lambda: self.sampler.warm(num_reqs, flags)

    def _warmed(self) -> None:
        self.guard.arm()
        logger.info(
            "compiled %d buckets %s (requests %s), %d sampler variants",
            len(self.buckets.buckets),
            self.buckets.token_buckets,
            self.buckets.request_sizes,
            len(self.sampler.variants),
        )

    def _warm_bucket(self, bucket: Bucket, caches: Caches) -> None:
        batch = self._pack([], bucket)
        fed_ids = abstract_like(self.no_feed)
        self.program.precompile(self.params, caches, batch, fed_ids, **self._images(True))

    def _images(self, abstract: bool = False) -> dict:
        """The step's ``images`` argument (a vision-language model's), else none."""
        if self.encoder is None:
            return {}
        images = self.encoder.images
        return {"images": abstract_like(images) if abstract else images}

    def _warm_swap(self) -> None:
        self.kv_caches = self.swap.warm(self.program, self.kv_caches)
        if self.host_states is not None:
            self.host_states.precompile(abstract_like(self.kv_caches))

    # ------------------------------------------------------------------ step

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one scheduled step; returns one entry per scheduled request."""
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Dispatches one scheduled step without waiting for it (see module doc)."""
        with self.guard.watching():
            if self.host_states is not None:  # before the table frees their slots
                self.host_states.stash(self.kv_caches, out, self.table)
            self.table.apply(out)
            if self.proposer is not None:
                self.proposer.forget(_restarted(out))
            self._swap(out)
            self._copy_states(out.state_restores, restore=True)
            if out.encoder_inputs:
                self.encoder.run(out.encoder_inputs, self.compiles.ensure)
            order = list(out.num_scheduled_tokens)
            if not order:
                return PendingStep(self, out, [], [], [], [], [], None, self._pools)
            states = [self.table[r] for r in order]
            feed, self._feed = self._feed, None
            slots = self._lora_slots(states)
            chunks, fed = self._chunks(out, order, states, feed, slots)
            sampling = (  # a pooling model's requests sample nothing
                [None] * len(order)
                if self.settings.pooler is not None
                else step_sampling_rows(out, order, states, fed)
            )
            groups = self.program.micro_batches([len(c.token_ids) for c in chunks])
            if len(groups) > 1 and any(f is not None for f in fed):
                raise RuntimeError("a fed token id needs one micro-batch (async scheduling)")
            fed_ids = self.no_feed if feed is None else feed.ids
            # dispatch every micro-batch's forward and sampling before reading any
            # result, so pipeline stages work on different micro-batches at once
            launched = [self._launch(g, chunks, sampling, fed, fed_ids, order) for g in groups]
            self._copy_states(out.state_saves, restore=False)
            if len(launched) == 1:
                part = launched[0]
                pairs = zip(part.rows, part.group, strict=True)
                rows = {order[i]: row for row, i in pairs if sampling[i]}
                self._feed = Feed(part.result[0], rows) if rows else None
            return PendingStep(
                self, out, order, states, chunks, launched, sampling, self._feed, self._pools
            )

    def _lora_slots(self, states: list[RequestState]) -> list[int]:
        """Each request's adapter slot, the adapters it needs written in first."""
        if self.lora is None:
            return [0] * len(states)
        self.compiles.ensure(("lora_write",))
        self.params, slots = self.lora.assign(self.params, [s.lora_request for s in states])
        return slots

    def _chunks(self, out: SchedulerOutput, order: list[str], states: list, feed, slots: list):
        """Each request's `SeqChunk` (its computed count advanced past it, its adapter
        slot set) and the row of ``feed`` (a `_Feed` or None) that gives its last
        token's id, or None when the id is known."""
        chunks, fed = [], []
        for req_id, state, slot in zip(order, states, slots, strict=True):
            drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
            n = out.num_scheduled_tokens[req_id] - len(drafts)
            chunk = self.table.chunk(state, n)
            if slot:
                chunk = dataclasses.replace(chunk, lora_slot=slot)
            if state.images:
                fields = self.encoder.chunk_fields(
                    state.images, chunk.num_computed, n, state.image_grids
                )
                chunk = dataclasses.replace(chunk, **fields)
            row = None
            if drafts and len(chunk.token_ids) == n:
                ids = [*chunk.token_ids, *drafts]
                chunk = dataclasses.replace(chunk, token_ids=ids, num_logits=1 + len(drafts))
            elif len(chunk.token_ids) < n:
                row = None if feed is None else feed.rows.get(req_id)
                if row is None or len(chunk.token_ids) != n - 1 or drafts:
                    raise RuntimeError(f"{req_id}: scheduled past its known tokens")
                chunk = dataclasses.replace(chunk, token_ids=[*chunk.token_ids, 0])
            chunks.append(chunk)
            fed.append(row)
            state.num_computed += len(chunk.token_ids)
        return chunks, fed

    def _swap(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            self.swap.swap_out(self.program, self.kv_caches, list(out.blocks_to_swap_out))
        if out.blocks_to_swap_in:
            pairs = list(out.blocks_to_swap_in)
            self.kv_caches = self.swap.swap_in(self.program, self.kv_caches, pairs)
        if self.host_states is not None:
            self.kv_caches = self.host_states.restore(self.kv_caches, out, self.table)

    def _copy_states(self, pairs: tuple, restore: bool) -> None:
        """A hybrid model's saved states in (``restore``) or out (`runner.states`)."""
        if pairs:
            self.compiles.ensure(("state_copy",))
            rows = slot_pairs(self.table, pairs, restore)
            self.kv_caches = self.state_copier.copy(self.kv_caches, rows)

    # ------------------------------------------------------------------ read back

    @property
    def _pools(self) -> bool:
        return self.settings.pooler is not None

    def collected(self, feed: Feed | None) -> None:
        """`PendingStep`'s: the step that sampled ``feed`` is read back."""
        if feed is not None and self._feed is feed:
            self._feed = None  # its tokens are known on the host from here on

    def pooled(self, step: PendingStep) -> RunnerOutput:
        """A pooling model's step (`runner.pooled`)."""
        (part,) = step.launched
        heads = self._heads if self.classifier is not None else None
        return pooled_output(
            step.order, step.states, step.chunks, part.hidden, self.settings.pooler, heads
        )

    def _heads(self, pooled: list[np.ndarray], params: list) -> list[np.ndarray]:
        self.compiles.ensure(("classify",))
        return classifier_heads(pooled, params, self.settings.max_num_seqs, self._classify)

    def _classify(self, rows: np.ndarray) -> np.ndarray:
        n, width = self.settings.max_num_seqs, self.settings.hidden_size
        return padded_logits(self.classifier, self.params, rows, n, width)

    def prompt_logprobs(
        self, part: Launched, states: list[RequestState], chunks: list[SeqChunk]
    ) -> list | None:
        """`PendingStep`'s: the prompt logprobs of one micro-batch (`runner.logprobs`)."""

        def compute(targets):
            return self.program.prompt_logprobs(self.params, part.hidden, targets)

        return prompt_logprobs(compute, part.bucket.num_tokens, states, chunks)

    def propose(self, step: PendingStep) -> list[list[int]] | None:
        """Each request's proposals for its next step (speculative decoding): none for
        one mid-prefill (the scheduler cuts those a grammar does not allow)."""
        if self.proposer is None:
            return None
        rows = np.cumsum([0] + [len(c.token_ids) for c in step.chunks]).tolist()
        inputs = [
            ProposalInput(
                req_id,
                state.token_ids,
                state.num_computed,
                self.table.block_table[state.row, : state.num_pages],
                sampling is not None,
                chunk.num_computed,
                row,
            )
            for req_id, state, sampling, chunk, row in zip(
                step.order, step.states, step.sampling, step.chunks, rows, strict=False
            )
        ]
        single = len(step.launched) == 1
        features = StepFeatures(step.launched[0].hidden, self.params) if single else None
        return self.proposer.propose(inputs, features, self.compiles.ensure)

    def _pack(self, chunks: list[SeqChunk], bucket: Bucket) -> PackedBatch:
        return pack_batch(
            chunks,
            page_size=self.settings.block_size,
            num_tokens=bucket.num_tokens,
            num_reqs=bucket.num_reqs,
            pages_per_req=self.pages_per_req,
            num_logits=bucket.num_logits,
            images=self.encoder is not None,
            both_ways=self.encoder is not None and self.encoder.both_ways,
            mrope=self.encoder is not None and self.encoder.mrope,
            states=self.settings.state_shapes is not None,
        )

    def _launch(
        self, group: list[int], chunks: list[SeqChunk], sampling: list, fed: list, fed_ids, order
    ):
        """Packs, runs and samples one micro-batch without waiting for it."""
        mine = [chunks[i] for i in group]
        bucket = self.buckets.select(sum(len(c.token_ids) for c in mine), len(mine))
        batch = self._pack(mine, bucket)
        for r, i in enumerate(group):
            if fed[i] is not None:
                batch.feed_rows[batch.query_start_loc[r + 1] - 1] = fed[i]
        starts = np.cumsum([0] + [c.num_logits for c in mine])[:-1].tolist()
        if self.calibrate_kv:
            self._calibrate_kv_scales(mine)
        self.compiles.ensure(("step", bucket))
        logits, hidden, self.kv_caches = self.program.step(
            self.params, self.kv_caches, batch, fed_ids, **self._images()
        )
        rows, ids = [], []
        for c, i in zip(mine, group, strict=True):
            rows += sampling[i] or [None] * c.num_logits
            ids += [order[i]] * c.num_logits
        result = None if logits is None else self._sample(bucket, logits, rows, ids)
        return Launched(group, bucket, hidden, result, starts)

    def _calibrate_kv_scales(self, chunks: list[SeqChunk]) -> None:
        """Sets the KV scales from the first step's batch (`runner.kv_scales`), run in
        the largest bucket (compiled at warm-up)."""
        self.compiles.ensure(("kv_amax",))
        batch = self._pack(chunks, self.buckets.buckets[-1])
        amax = self.program.kv_amax(self.params, self.kv_caches, batch)
        self.params = with_kv_scales(self.params, amax)
        self.calibrate_kv = False
        logger.info("KV cache scales calculated from the first batch (%d tokens)",
                    sum(len(c.token_ids) for c in chunks))  # fmt: skip

    def _sample(self, bucket: Bucket, logits, rows: list, ids: list[str]):
        settings = self.settings
        batch = SamplingBatch(
            rows, bucket.num_logits, settings.vocab_size, eos_token_id=settings.eos_token_id
        )
        needed = batch.required_flags(settings.logprobs_mode)
        flags = pick_variant(needed, self.sampler.variants) or needed
        self.compiles.ensure(("sample", bucket.num_logits, flags))
        if batch.any_logits_processors:
            host = apply_logits_processors(np.asarray(logits), batch.rows)
            logits = self.sampler.to_device(host)
        metadata = batch.to_metadata(flags)
        if self.sampler.processors:  # custom logits processors: each row's request
            states = self.sampler.processors.step(ids, rows, bucket.num_logits)
            metadata = metadata._replace(processor_states=states)
        result = self.sampler.sample(logits, metadata, flags)
        return result.token_ids, result.logprobs

    # ------------------------------------------------------------------ lifetime

    @property
    def compiles_after_warmup(self) -> int:
        return self.guard.compiles_after_warmup

    def release(self) -> None:
        """Disarms the compile guard and deletes the device buffers (parameters and KV
        caches); the runner cannot run after this."""
        self.compiles.close()
        self.guard.close()
        self.table.clear()
        self.sampler.processors.clear()
        self._feed = None
        if self.proposer is not None:
            self.proposer.release()
        delete_arrays((self.params, self.kv_caches, self.no_feed))
        self.params = self.kv_caches = None
        self.swap = None


def _restarted(out: SchedulerOutput) -> list[str]:
    """Requests whose proposer state no longer holds: finished, preempted, resumed."""
    resumed = [c.req_id for c in out.scheduled_cached_reqs if c.resumed_from_preemption]
    return [*out.finished_req_ids, *out.preempted_req_ids, *resumed]
