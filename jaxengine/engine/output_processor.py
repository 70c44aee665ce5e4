"""Turning the scheduler's per-step token ids into `RequestOutput`s (host side).

Per sequence: incremental detokenization, stop strings (which finish the sequence
through the scheduler), logprobs as `Logprob` dicts, and timing. Per request: its
``n`` sequences are separate scheduler requests (``{index}_{request_id}``) whose
outputs are gathered into one `RequestOutput`, emitted by the request's output kind.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxengine.metrics.stats import FinishedRequestStats, IterationStats
from jaxengine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    logprobs_dict,
)
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from jaxengine.tokenizer.detokenizer import IncrementalDetokenizer


def child_id(request_id: str, index: int, n: int) -> str:
    """Scheduler id of sequence ``index`` of a request (the id itself when n == 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclasses.dataclass
class SequenceState:
    """One generated sequence of a request."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False
    """DELTA outputs: the finish reason has been emitted (each sequence ends once)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestState:
    """A user request: prompt, params, and its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    """Preemptions of its sequences, from the scheduler's steps (`mark_preempted`)."""
    lora_request: Any = None
    pooled: Any = None
    """A pooling request's result (`PoolingParams`), once it has finished."""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


class OutputProcessor:
    """Applies `EngineCoreOutput`s to request states and builds `RequestOutput`s."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.by_child: dict[str, tuple[RequestState, SequenceState]] = {}
        self.stats = IterationStats()
        """Statistics since the last `take_stats()`."""

    def take_stats(self) -> IterationStats:
        """The statistics gathered since the last call (a new record starts)."""
        stats, self.stats = self.stats, IterationStats()
        return stats

    def mark_scheduled(self, child_ids, now: float) -> None:
        """Records the first schedule of requests (for queue-time metrics)."""
        for cid in child_ids:
            entry = self.by_child.get(cid)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                metrics = entry[0].metrics
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time

    def mark_preempted(self, child_ids) -> None:
        """Counts one preemption for each scheduler id (a step's
        ``SchedulerOutput.preempted_req_ids``) on its request."""
        for cid in child_ids:
            entry = self.by_child.get(cid)
            if entry is not None:
                entry[0].num_preemptions += 1

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        lora_request: Any = None,
    ) -> list[str]:
        """Registers a request; returns the scheduler ids of its sequences."""
        sequences = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
            seq = SequenceState(i, params, detok)
            if params.logprobs_top_k is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            sequences.append(seq)
        state = RequestState(
            request_id,
            prompt,
            prompt_ids,
            params,
            sequences,
            RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time),
            lora_request=lora_request,
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        ids = [child_id(request_id, i, params.n) for i in range(params.n)]
        for cid, seq in zip(ids, sequences, strict=True):
            self.by_child[cid] = (state, seq)
        return ids

    def process(self, outputs: list) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Applies one step; returns (outputs to emit, (child id, stop string) stops)."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stops = []
        for out in outputs:
            entry = self.by_child.get(out.request_id)
            if entry is None:
                continue
            state, seq = entry
            touched[state.request_id] = state
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens or 0)
            if out.pooling_output is not None:
                state.pooled = out.pooling_output
            if out.new_token_ids:
                if not seq.token_ids:  # this sequence's first token
                    self.stats.prefilled_request_ids.append(state.request_id)
                self._record_tokens(state, len(out.new_token_ids), now)
                stop = self._add_tokens(seq, out.new_token_ids, out.new_logprobs, out.finished)
                if stop is not None:
                    stops.append((out.request_id, stop))
                    continue
            if out.finished and not seq.finished:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                self._flush(seq)
        emitted = []
        for state in touched.values():
            result = self._make_output(state, now)
            if result is not None:
                emitted.append(result)
            if state.finished:
                self._record_finished(state, now)
                self._forget(state)
        return emitted, stops

    def abort_with_output(self, request_id: str, now: float) -> tuple[list[str], Any]:
        """`abort`, and the request's last output: its sequences finished with reason
        ``abort`` (None for a pooling request, which has no partial result)."""
        state = self.requests.get(request_id)
        output = None
        if state is not None and not isinstance(state.params, PoolingParams):
            for seq in state.sequences:
                if not seq.finished:
                    seq.finish_reason = "abort"
            output = self._make_output(state, now)
        return self.abort(request_id), output

    def abort(self, request_id: str) -> list[str]:
        """Forgets a request; returns its scheduler ids (to abort there too)."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        ids = [child_id(request_id, s.index, state.params.n) for s in state.sequences]
        self._forget(state)
        self.stats.num_aborted += 1
        return ids

    # ------------------------------------------------------------------ details

    def _record_tokens(self, state: RequestState, count: int, now: float) -> None:
        metrics, stats = state.metrics, self.stats
        stats.num_generation_tokens += count
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.num_cached_prompt_tokens += min(
                state.num_cached_tokens, len(state.prompt_token_ids)
            )
            stats.time_to_first_tokens.append(now - metrics.arrival_time)
        elif now > metrics.last_token_time:  # once per step, for n > 1 too
            stats.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now

    def _record_finished(self, state: RequestState, now: float) -> None:
        m = state.metrics
        reason = state.sequences[0].finish_reason
        if reason not in ("stop", "length"):
            return
        first = m.first_token_time if m.first_token_time is not None else now
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else first
        decode = now - first
        longest = max(len(s.token_ids) for s in state.sequences)
        self.stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=now - m.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=sum(len(s.token_ids) for s in state.sequences),
                max_tokens=getattr(state.params, "max_tokens", None),
                queued_time=scheduled - m.arrival_time,
                prefill_time=first - scheduled,
                decode_time=decode,
                time_per_output_token=decode / (longest - 1) if longest > 1 else 0.0,
                n=len(state.sequences),
                max_num_generation_tokens=longest,
                num_cached_tokens=min(state.num_cached_tokens, len(state.prompt_token_ids)),
                num_preemptions=state.num_preemptions,
            )
        )

    def _add_tokens(self, seq: SequenceState, new_ids, new_logprobs, finishing: bool):
        """Appends tokens; returns the stop string if one now ends the sequence. Several
        tokens of one step (accepted proposals) meet the stop strings one at a time:
        those after the token that completes a stop string are dropped, as decoding a
        token per step would never have made them."""
        if len(new_ids) > 1 and seq.params.stop and seq.detokenizer is not None:
            entries = [None] * len(new_ids) if new_logprobs is None else _as_list(new_logprobs)
            for j, token in enumerate(new_ids):
                last = j == len(new_ids) - 1
                stop = self._add_tokens(seq, [token], entries[j], finishing and last)
                if stop is not None:
                    return stop
            return None
        seq.token_ids.extend(new_ids)
        if seq.logprobs is not None and new_logprobs is not None:
            for token, entry in zip(new_ids, _as_list(new_logprobs), strict=False):
                if entry is None:
                    continue
                lp, rank, top_ids, top_lps, *top_ranks = entry  # ranks: logprob_token_ids
                seq.logprobs.append(
                    self._decorate(logprobs_dict(token, lp, rank, top_ids, top_lps, *top_ranks))
                )
                seq.cumulative_logprob += lp
        if seq.detokenizer is None:
            return None
        checked = len(seq.text)
        seq.text += seq.detokenizer.update(new_ids, final=finishing)
        return self._check_stop_strings(seq, checked)

    def _check_stop_strings(self, seq: SequenceState, checked: int):
        """Finds a stop string in the text added after offset ``checked``."""
        stops = seq.params.stop
        if not stops or seq.finished:
            return None
        for stop in stops:
            at = seq.text.find(stop, max(0, checked - len(stop) + 1))
            if at != -1:
                end = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.text = seq.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return stop
        return None

    def _flush(self, seq: SequenceState) -> None:
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()

    def _decorate(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return entry
        for token, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([token])
        return entry

    def _add_prompt_logprobs(self, state: RequestState, entries) -> None:
        for position, target, lp, rank, top_ids, top_lps in entries:
            while len(state.prompt_logprobs) < position:
                state.prompt_logprobs.append(None)
            item = self._decorate(logprobs_dict(target, lp, rank, top_ids, top_lps))
            if len(state.prompt_logprobs) == position:
                state.prompt_logprobs.append(item)
            else:
                state.prompt_logprobs[position] = item

    def _make_output(self, state: RequestState, now: float) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished:
            state.metrics.finished_time = now
        if isinstance(state.params, PoolingParams):
            return PoolingRequestOutput(
                state.request_id,
                PoolingOutput(state.pooled),
                state.prompt_token_ids,
                finished,
                state.prompt,
                state.metrics,
                state.lora_request,
                state.num_cached_tokens,
            )
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for seq in state.sequences:
            if (
                delta
                and seq.sent_tokens == len(seq.token_ids)
                and (not seq.finished or seq.sent_finish)
            ):
                continue
            tokens = seq.token_ids[seq.sent_tokens :] if delta else list(seq.token_ids)
            text = seq.text[seq.sent_text :] if delta else seq.text
            lps = (
                seq.logprobs[seq.sent_tokens :]
                if delta and seq.logprobs is not None
                else seq.logprobs
            )
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=lps,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            if delta:
                seq.sent_tokens, seq.sent_text = len(seq.token_ids), len(seq.text)
                seq.sent_finish = seq.finished
        state.metrics.num_generation_tokens = sum(len(s.token_ids) for s in state.sequences)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            lora_request=state.lora_request,
        )

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for seq in state.sequences:
            self.by_child.pop(child_id(state.request_id, seq.index, state.params.n), None)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]
