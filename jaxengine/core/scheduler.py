"""The scheduler: one token budget per step, no prefill/decode phases.

Contract (the engine core loop):

    out = scheduler.schedule()                 # SchedulerOutput
    res = runner.execute(out)                  # RunnerOutput
    outputs = scheduler.update(out, res)       # list[EngineCoreOutput]

`update` follows each `schedule`, either before the next one or (async scheduling)
right after it: at most one step is in flight. `add_request`, `abort_requests` and
`finish_requests` may be called at any point between calls.

A scheduled step that samples for a request adds one output placeholder to it
(`Request.num_output_placeholders`) until its `update` appends the token. A
running request is scheduled up to its known tokens plus its placeholders: with a
step in flight, the next step computes the position of the token still being
sampled, and the runner feeds that token on device. A request is not scheduled
past a placeholder that max_tokens or max_model_len makes its last, nor while its
sampling needs its outputs on the host (`Request.needs_known_outputs`). A request
preempted while one of its tokens is in flight still receives that token.

Each step every request's computed-token count catches up with its token count within
one budget (`max_num_batched_tokens`) and one request cap (`max_num_seqs`):

1. `_schedule_running`: running requests in order, each `num_tokens -
   num_computed_tokens` tokens (a decode is 1), capped by the remaining budget (and the
   long-prefill threshold). When blocks run out, `_preempt` the policy's victim (swap
   to host if there is room, else recompute) until the request fits or is the victim.
2. `_schedule_waiting` (skipped in a step that preempted): waiting requests in policy
   order. Prefix-cache hits are skipped (a hybrid model's stop at a saved state, and
   its partial prefill chunks end at a block's end, where states are saved:
   `core.kv_cache.state_cache`); the rest is chunked to the budget (without
   chunked prefill a prompt that does not fit waits). The partial-prefill limiter may
   skip a prompt that would be left part-way, letting later ones in. A request that
   lacks blocks stops admission (head-of-line order is kept). A LoRA request waits
   while ``max_loras`` other adapters run; its adapter is pinned on the host from its
   first admission until it finishes (`core.adapters`), and one that can no longer
   be read fails that request alone, as a grammar that cannot compile does.

Speculative decoding (``num_speculative_tokens`` > 0): a decoding request with
proposals (`Request.spec_token_ids`, from the previous step's `RunnerOutput`) is
scheduled for its last token plus as many proposals as the budget, max_tokens and
max_model_len leave room for (`SchedulerOutput.scheduled_spec_decode_tokens`); its
blocks cover them all. `update` takes back the rejected ones: num_computed_tokens
drops by their count, so the prefix cache only ever publishes accepted tokens, and
their slots are written again by later steps.

Invariants: every step's total <= max_num_batched_tokens; running <= max_num_seqs; a
request's blocks are freed when it finishes, aborts or is recompute-preempted, so after
draining every block is free.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxengine.core.adapters import AdapterPins, lora_counts
from jaxengine.core.encoder_cache import EncoderCache, EncoderScheduler
from jaxengine.core.grammar import GrammarTracker
from jaxengine.core.kv_cache.manager import KVCacheManager
from jaxengine.core.limits import SchedulerLimits
from jaxengine.core.policy import PartialPrefillLimiter, get_policy
from jaxengine.core.request import Request, RequestStatus, check_stop
from jaxengine.core.sched_output import (
    EngineCoreOutput,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from jaxengine.core.spec_tokens import take_back_rejected
from jaxengine.core.step_plan import StepPlan, Verdict, step_output

_RS = RequestStatus


class Scheduler:
    """Decides, each step, which requests compute how many tokens (see module doc)."""

    def __init__(
        self,
        limits: SchedulerLimits,
        grammars: GrammarTracker | None = None,
        adapters: AdapterPins | None = None,
    ) -> None:
        """``grammars`` (structured outputs): holds waiting requests until their grammar
        is compiled, gives each step's bitmask rows, and follows the sampled tokens.
        ``adapters`` (LoRA): pins the adapters of admitted requests on the host."""
        self.limits = limits
        self.grammars = grammars
        self.adapters = adapters
        self._pinned: set[str] = set()  # requests whose adapter is pinned
        self._failed: list[EngineCoreOutput] = []
        self.kv = KVCacheManager(
            limits.num_blocks,
            limits.block_size,
            enable_caching=limits.enable_prefix_caching,
            hash_algo=limits.prefix_caching_hash_algo,
            num_host_blocks=limits.num_host_blocks,
            state_rows=limits.state_cache_rows,
        )
        self.policy = get_policy(limits.scheduling_policy)
        self.partial = PartialPrefillLimiter(
            limits.max_num_partial_prefills,
            limits.max_long_partial_prefills,
            limits.long_prefill_token_threshold,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.make_queue()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_deferred = 0  # waiting requests the last admission pass skipped
        self.spec_stats = SpecDecodingStats()
        rows = limits.encoder_cache_rows  # images: `core.encoder_cache`
        whole = limits.whole_images
        self.encoder = EncoderScheduler(EncoderCache(rows), rows, whole) if rows else None

    # ---- requests in and out -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError on a duplicate id or a prompt longer
        than max_model_len."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens > self.limits.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_model_len={self.limits.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = _RS.FINISHED_STOPPED,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish requests by id in any state, freeing all their blocks. Unknown or
        already finished ids are ignored. Used for string stops and aborts."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is not _RS.RUNNING:
                self.waiting.remove(req)
            req.status, req.stop_reason = status, stop_reason
            done.append(req)
        self._release(done)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any state (waiting, running, preempted, swapped)."""
        self.finish_requests(request_ids, _RS.FINISHED_ABORTED)

    def _release(self, done: list[Request]) -> None:
        if not done:
            return
        ids = {r.request_id for r in done}
        self.running = [r for r in self.running if r.request_id not in ids]
        for req in done:
            self.kv.free(req)
            self._drop_images(req)
            if self.grammars is not None:
                self.grammars.free(req.request_id)
            if req.request_id in self._pinned:
                self._pinned.remove(req.request_id)
                self.adapters.unpin_lora(req.lora_request.lora_int_id)
            del self.requests[req.request_id]
            if req.num_cached_tokens >= 0:  # the runner has seen it
                self._finished_ids.add(req.request_id)

    def _drop_images(self, req: Request) -> None:
        if self.encoder is not None and req.mm_items:
            self.encoder.cache.release_all(req.request_id, [i.key for i in req.mm_items])

    # ---- queries -----------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, preempted and swapped ones included."""
        return len(self.waiting)

    def needs_known_outputs(self) -> bool:
        """Whether a running request's next sampling reads its outputs on the host
        (the next step must wait for the previous one's update)."""
        return any(r.needs_known_outputs for r in self.running)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=sum(1 for r in self.waiting if r.status is _RS.SWAPPED),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            running_lora_adapters=lora_counts(self.running),
            waiting_lora_adapters=lora_counts(self.waiting),
            max_lora=self.limits.max_loras,
            spec_decoding=self.spec_stats if self.limits.num_speculative_tokens else None,
            num_deferred=min(self.num_deferred, len(self.waiting)),
            **self.kv.block_stats(),
            **(self.encoder.stats() if self.encoder is not None else {}),
        )

    def reset_prefix_cache(self) -> bool:
        if self.encoder is not None:  # (sleep drops the rows too: `runner.sleep`)
            self.encoder.cache.reset()
        return self.kv.reset_prefix_cache()

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step (see module doc). Advances num_computed_tokens of every
        scheduled request by its scheduled count."""
        step = StepPlan(budget=self.limits.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        images = self.encoder.finish_step() if self.encoder is not None else ()
        return step_output(step, self.requests, finished, self.grammars, images)

    def _cap(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        threshold = self.limits.long_prefill_token_threshold
        if self.limits.enable_chunked_prefill and threshold > 0:
            n = min(n, threshold)
        return n

    def _schedule_running(self, step: StepPlan) -> None:
        for req in list(self.running):
            if req.status is not _RS.RUNNING:  # preempted earlier in this loop
                continue
            if step.budget <= 0:
                break
            if req.waits_for_placeholder(self.limits.max_model_len):
                continue
            remaining = req.num_tokens_with_placeholders - req.num_computed_tokens
            drafts = self._drafts(req, remaining, step.budget)
            n = remaining + len(drafts) if drafts else self._cap(remaining, step.budget)
            n = self._images(req, req.num_computed_tokens, n)
            n = self.kv.chunk_end(req, req.num_computed_tokens, n)
            if n <= 0 or (n < remaining and not self.limits.enable_chunked_prefill):
                continue
            extra = self._lookahead(req, req.num_computed_tokens + n)
            while (block_ids := self.kv.allocate_slots(req, n + extra)) is None:
                victim = self.policy.choose_victim(self.running)
                self._preempt(victim, step)
                if victim is req:
                    break
            if block_ids is not None:
                save = self.kv.reserve_state_save(req, req.num_computed_tokens + n)
                step.add(req, n, block_ids, save)
                if drafts:
                    step.spec[req.request_id] = drafts

    def _images(self, req: Request, start: int, n: int) -> int:
        """``n``, or fewer: up to the first image that cannot be encoded this step."""
        if self.encoder is None or not req.mm_items:
            return n
        return self.encoder.plan(req, start, n)

    def _lookahead(self, req: Request, end: int) -> int:
        """KV slots to allocate past position ``end`` (a draft model writes its
        proposals' KV there): only when the step samples for ``req``."""
        if not self.limits.num_lookahead_tokens or end < req.num_tokens_with_placeholders:
            return 0
        return max(min(self.limits.num_lookahead_tokens, self.limits.max_model_len - end), 0)

    def _drafts(self, req: Request, remaining: int, budget: int) -> tuple[int, ...]:
        """The proposals `req` verifies this step: only when it decodes (one token to
        compute), as many as the budget, max_tokens and max_model_len leave room for."""
        if not req.spec_token_ids or remaining != 1 or req.num_output_placeholders:
            return ()
        room = min(budget - 1, self.limits.max_model_len - req.num_tokens - 1)
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_output_tokens - 1)
        drafts = tuple(req.spec_token_ids[: max(room, 0)])
        if drafts and self.grammars is not None:
            drafts = self.grammars.check_drafts(req, drafts)
        return drafts

    def _preempt(self, victim: Request, step: StepPlan) -> None:
        """Take `victim` out of the running set: its KV goes to host blocks when there is
        room (SWAPPED), else its blocks are freed and it will be recomputed (PREEMPTED).
        Either way it re-enters the waiting queue at its policy position (front for fcfs)
        and keeps its output tokens."""
        self.running.remove(victim)
        step.drop(victim)
        victim.spec_token_ids = []
        self._drop_images(victim)
        if self.kv.can_swap_out(victim):
            step.swap_out.extend(self.kv.swap_out(victim))
            victim.status = _RS.SWAPPED
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = _RS.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.add(victim.request_id)
        self.waiting.prepend(victim)

    def _schedule_waiting(self, step: StepPlan) -> None:
        skipped = []
        while self.waiting and step.budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting.peek()
            verdict = self._try_admit(req, step)
            if verdict is Verdict.STOP:
                break
            if verdict is Verdict.GONE:
                continue
            if verdict is Verdict.SKIP:
                skipped.append(self.waiting.pop())
        self.num_deferred = len(skipped)
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _try_admit(self, req: Request, step: StepPlan) -> Verdict:
        """Admit the waiting-queue head `req` if its grammar, the budget, the limiter and
        blocks allow."""
        grammar = self._grammar_verdict(req)
        if grammar is not None:
            return grammar
        lora = self._lora_verdict(req)
        if lora is not None:
            return lora
        if req.num_output_placeholders:  # preempted while a token was in flight
            return Verdict.SKIP
        swapped = req.status is _RS.SWAPPED
        if swapped:
            hit_ids, start = [], req.num_computed_tokens
        else:
            hit_ids, start = self.kv.get_computed_blocks(req)
        remaining = req.num_tokens - start
        verdict, n = self._admission_chunk(remaining, step, whole=req.pooling)
        if verdict is not Verdict.ADMIT:
            return verdict
        n = self.kv.chunk_end(req, start, self._images(req, start, n))
        if n <= 0 or (n < remaining and not self.limits.enable_chunked_prefill):
            return Verdict.STOP
        extra = self._lookahead(req, start + n)
        if swapped:
            if not self.kv.can_swap_in(req, n + extra):
                return Verdict.STOP
            step.swap_in.extend(self.kv.swap_in(req))
        if self.kv.allocate_slots(req, n + extra, hit_ids) is None:
            assert not swapped, "can_swap_in promised room"
            return Verdict.STOP
        self.waiting.pop()
        req.num_computed_tokens = start
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = start
            step.first_time.add(req.request_id)
        elif req.status in (_RS.PREEMPTED, _RS.SWAPPED):
            step.resumed.add(req.request_id)
        restore = self.kv.state_restore_row(req, len(hit_ids) * self.limits.block_size)
        save = self.kv.reserve_state_save(req, start + n)
        step.add(req, n, self.kv.get_block_ids(req.request_id), save, restore)
        req.status = _RS.RUNNING
        self.running.append(req)
        return Verdict.ADMIT

    def _lora_verdict(self, req: Request) -> Verdict | None:
        """SKIP unless ``req``'s adapter is running already or one more fits
        ``max_loras``; GONE (finished, reported at the next `update`) when its adapter
        cannot be pinned on the host; None when it may be admitted."""
        if req.lora_request is None:
            return None
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        lora_id = req.lora_request.lora_int_id
        if lora_id not in running and len(running) >= self.limits.max_loras:
            return Verdict.SKIP
        if self.adapters is None or req.request_id in self._pinned:
            return None
        try:
            self.adapters.pin_lora(req.lora_request)
        except ValueError as e:  # LoRAAdapterError: its folder is gone or changed
            self._fail(req, str(e))
            return Verdict.GONE
        self._pinned.add(req.request_id)
        return None

    def _grammar_verdict(self, req: Request) -> Verdict | None:
        """SKIP while a new request's grammar compiles; GONE (finished, reported at the
        next `update`) when it cannot compile; None when it may be admitted."""
        if self.grammars is None or req.status is not _RS.WAITING:
            return None
        try:
            return None if self.grammars.is_ready(req) else Verdict.SKIP
        except ValueError as e:
            self._fail(req, str(e))
            return Verdict.GONE

    def _fail(self, req: Request, error: str) -> None:
        """Finishes ``req`` aborted with ``error``, reported at the next `update`."""
        self.finish_requests(req.request_id, _RS.FINISHED_ABORTED, stop_reason=error)
        self._failed.append(EngineCoreOutput(req.request_id, [], "abort", error))

    def _admission_chunk(
        self, remaining: int, step: StepPlan, whole: bool = False
    ) -> tuple[Verdict, int]:
        """(verdict, tokens to schedule); ``whole``: all ``remaining`` or none (a
        pooling request's prompt runs in one step)."""
        n = min(remaining, step.budget) if whole else self._cap(remaining, step.budget)
        if n >= remaining:
            return Verdict.ADMIT, n
        if whole or not self.limits.enable_chunked_prefill or n <= 0:
            return Verdict.STOP, 0
        num_partial = num_long = 0
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left - step.num_scheduled.get(r.request_id, 0) > 1:
                num_partial += 1
                num_long += self.partial.is_long(left)
        if not self.partial.allows(remaining, num_partial, num_long):
            return Verdict.SKIP, 0
        return Verdict.ADMIT, n

    # ---- results -------------------------------------------------------------------
    def update(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: publish newly computed full blocks to the prefix
        cache, append sampled tokens, check stops (EOS, stop token ids, max_tokens,
        max_model_len) and free finished requests. Returns one output per request that
        got tokens, prompt logprobs, or finished. Requests aborted meanwhile are skipped."""
        partial = scheduler_output.partial_req_ids
        self.spec_stats = take_back_rejected(
            self.requests, scheduler_output, runner_output, self.spec_stats
        )
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid not in partial:
                req.num_output_placeholders -= 1
            if req.status is _RS.RUNNING:
                self.kv.cache_full_blocks(req)
        outputs, done = self._failed, []
        self._failed = []
        ro = runner_output
        for i, rid in enumerate(ro.req_ids):
            req = self.requests.get(rid)
            if req is None:  # finished or aborted since it was scheduled
                continue
            pooled = ro.pooler_output[i] if ro.pooler_output is not None else None
            if pooled is not None:
                req.status = _RS.FINISHED_STOPPED
                done.append(req)
                outputs.append(EngineCoreOutput(rid, [], "stop", pooling_output=pooled))
                continue
            new_ids = self._append_tokens(req, ro.sampled_token_ids[i], done)
            if self.grammars is not None and new_ids:
                self.grammars.accept(req, new_ids)
            if ro.spec_token_ids is not None and not req.is_finished:
                req.spec_token_ids = ro.spec_token_ids[i]
            logprobs = ro.logprobs[i] if ro.logprobs is not None else None
            prompt_lp = ro.prompt_logprobs[i] if ro.prompt_logprobs is not None else None
            if new_ids or prompt_lp is not None:
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        new_ids,
                        req.status.finish_reason,
                        req.stop_reason,
                        logprobs,
                        prompt_lp,
                        max(req.num_cached_tokens, 0),
                    )
                )
        for req in done:
            if req not in self.running:  # preempted while its last token was in flight
                self.waiting.remove(req)
        self._release(done)
        return outputs

    def _append_tokens(self, req: Request, tokens: list[int], done: list[Request]) -> list[int]:
        """Appends sampled tokens up to the first that finishes the request (then in
        ``done``); returns those appended."""
        new_ids = []
        for token in tokens:
            req.append_output_token_ids(token)
            new_ids.append(token)
            if check_stop(req, self.limits.max_model_len):
                done.append(req)
                break
        return new_ids
