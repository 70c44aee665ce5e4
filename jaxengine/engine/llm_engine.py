"""`LLMEngine`: one model's scheduler, runner and output processing, stepped in-process.

Construction loads the model and tokenizer, sizes the KV cache, builds the scheduler
and the runner, and compiles every bucket (unless ``--enforce-eager``). Each `step()`
is ``schedule -> executor.execute -> scheduler.update -> outputs``. The offline `LLM`
and the async server engine both drive this class; `shutdown()` ends its lifetime.

With ``--async-scheduling`` a step is ``schedule N+1 -> executor.submit(N+1) ->
update(N) -> outputs of N``: the host schedules, packs and dispatches the next step
and then processes the previous one's tokens while the device computes. One step is
in flight between calls. A step is scheduled only after the previous one's update
when a running request needs its outputs on the host (`Request.needs_known_outputs`)
or the schedule is empty.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.core.request import Request, RequestStatus
from jaxengine.core.sched_output import SchedulerOutput
from jaxengine.core.scheduler import Scheduler
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.rollout import RolloutControl
from jaxengine.engine_args import EngineArgs
from jaxengine.executor.abstract import StepResult
from jaxengine.inputs import PreparedPrompt
from jaxengine.logits_processor import resolve_logits_processors, validate_request
from jaxengine.multimodal.processor import media_refusal, prompt_images
from jaxengine.outputs import RequestOutput
from jaxengine.pooling_params import PoolingParams, plain_token_ids
from jaxengine.reasoning.budget import budget_support, requested_budget
from jaxengine.sampling_params import SamplingParams
from jaxengine.structured_output import make_manager

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens it asks for) exceeds the model's context."""


class LLMEngine:
    """Synchronous engine: `add_request`, `step`, `abort_request`."""

    def __init__(
        self, config: EngineConfig, *, warmup: bool = True, devices: Sequence[Any] | None = None
    ) -> None:
        """``devices``: this engine's (pipeline x tensor parallel size of them); by
        default the first ones. Data-parallel replicas each get their own. Across
        hosts (``--nnodes``, ``--distributed-executor-backend ray``) the executor
        drives the other hosts too (`jaxengine.executor.create_executor`)."""
        from jaxengine.executor import create_executor

        self.executor, host = create_executor(config, devices)
        self.config = host.config
        self.tokenizer = host.tokenizer
        self.generation_config = host.generation_config
        self.model_config = host.model
        self.max_model_len = host.config.model_config.max_model_len
        self.vocab_size = host.vocab_size
        self.eos_token_id = host.eos_token_id
        self.kv_cache_size = host.kv_size
        self.pooler = host.pooler
        self.images = host.images
        """A vision-language model's image processor (`multimodal.processor`), else None."""
        """A pooling model's pooler (`--runner pooling`), None for a generating one."""
        self.media_refusal = media_refusal(host.hf_config)
        """Why media are refused where a multimodal checkpoint runs as text only."""
        self.structured_outputs = None  # (a pooling model samples nothing to constrain)
        if self.pooler is None:
            self.structured_outputs = make_manager(
                self.config.structured_outputs_config,
                self.tokenizer,
                self.vocab_size,
                self.eos_token_id,
            )
        pins = self.executor if self.config.lora_config.enable_lora else None
        self.scheduler = Scheduler(host.limits, self.structured_outputs, pins)
        self.outputs = OutputProcessor(self.tokenizer)
        self.async_scheduling = self.config.scheduler_config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepResult] | None = None
        self._shut_down = False
        self.rollout = RolloutControl([self], self._checkpoint_tensors)
        """Sleep mode and weight updates (RL rollouts: `engine.rollout`)."""
        self.logits_processors = resolve_logits_processors(
            self.config.model_config.logits_processors
        )
        """The custom logits processors' classes: their ``validate_params`` (the
        runners hold the instances)."""
        self.thinking_budget = budget_support(self.config, self.tokenizer, self.pooler is not None)
        """Whether requests may name a ``thinking_token_budget`` (`reasoning.budget`)."""
        if warmup and not self.config.model_config.enforce_eager:
            self.executor.warmup()

    def _checkpoint_tensors(self, path: str | None):
        from jaxengine.loader import checkpoint_tensors

        return checkpoint_tensors(self.config.model_config, self.config.load_config, path)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) of a text, ids or `{"prompt_token_ids"}`."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (--skip-tokenizer-init is set)")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def prepare(
        self, prompt: str | list[int] | dict, params: SamplingParams, lora_request: Any = None
    ) -> PreparedPrompt:
        """Tokenizes, truncates and validates a prompt, and reads its LoRA adapter
        (`add_lora`); raises ValueError if either is bad."""
        items = ()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, ids, items = self._prompt_images(prompt, params)
        else:
            text, ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams) or self.pooler is not None:
            params, ids = self._prepare_pooling(params, ids)
            return PreparedPrompt(text, ids, params, lora_request)
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > 0:
            ids = ids[-params.truncate_prompt_tokens :]
        params = self._prepare_params(params, len(ids))
        self._check_prompt(ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        return PreparedPrompt(text, ids, params, lora_request, tuple(items))

    def _prompt_images(self, prompt: dict, params: Any) -> tuple[str, list[int], list]:
        """A prompt with ``multi_modal_data`` through the model's processor."""
        if isinstance(params, PoolingParams) or self.pooler is not None:
            raise ValueError("images are not supported by pooling models yet")
        if getattr(params, "truncate_prompt_tokens", None):
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        limit = self.config.multimodal_config.limit("image")
        rows = self.scheduler.limits.encoder_cache_rows
        text, ids, items = prompt_images(prompt, self.images, limit, rows, self.media_refusal)
        self._check_whole_images(items)
        if not self.config.scheduler_config.enable_chunked_prefill:
            if sum(i.num_embeds for i in items) > rows:
                raise ValueError(
                    f"the prompt's images take {sum(i.num_embeds for i in items)} "
                    f"embeddings, more than the {rows} one step encodes: enable "
                    "chunked prefill or raise --max-num-batched-tokens"
                )
        return text, ids, items

    def _check_whole_images(self, items: list) -> None:
        """Where an image's tokens attend both ways, each image must fit one step."""
        sc = self.config.scheduler_config
        step = sc.max_num_batched_tokens
        if sc.enable_chunked_prefill and sc.long_prefill_token_threshold > 0:
            step = min(step, sc.long_prefill_token_threshold)
        longest = max((i.end - i.start for i in items), default=0)
        if self.images.bidirectional and longest > step:
            raise ValueError(
                f"an image of {longest} tokens must be prefilled in one step, but a step "
                f"takes at most {step} tokens of a prompt: raise --max-num-batched-tokens"
            )

    def _prepare_pooling(self, params: Any, ids: list[int]) -> tuple[PoolingParams, list[int]]:
        """A pooling request's checked parameters and (truncated) prompt."""
        if self.pooler is None:
            raise ValueError(
                "this model generates text and serves no embeddings: start it with "
                "--runner pooling (--convert embed for a generative model)"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(
                "--runner pooling: this engine serves embeddings (LLM.embed, "
                "/v1/embeddings), not text generation"
            )
        params = params.clone()
        self._check_task(params)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            ids = ids[-(self.max_model_len if keep == -1 else keep) :]
        plain = plain_token_ids(ids)
        if plain != ids and not getattr(self.model_config, "type_vocab_size", 0) > 1:
            raise ValueError("token types (a text pair) need a model with token types (BERT)")
        self._check_prompt(plain, None)
        self._check_dimensions(params)
        budget = self.config.scheduler_config.max_num_batched_tokens
        if len(ids) > budget:
            raise PromptTooLongError(
                f"the input has {len(ids)} tokens; a pooling request runs in one step of at "
                f"most --max-num-batched-tokens {budget} tokens"
            )
        return params, ids

    def _check_task(self, params: PoolingParams) -> None:
        tasks = self.pooler.tasks
        if params.task is None or params.task in tasks:
            return
        if params.task in ("classify", "score"):
            raise ValueError(
                f"the {params.task} task needs a model with a classification head "
                "(*ForSequenceClassification, or --convert classify); this one has no "
                "classification head"
            )
        if self.pooler.num_labels:
            raise ValueError(
                "this is a classification model: use classify or score (LLM.classify, "
                "LLM.score, /classify, /score, /rerank), not embeddings"
            )
        kind = "a reward model (--convert reward)" if "embed" not in tasks else "an embedding model"
        raise ValueError(
            f"the {params.task} task is not one of this model's: it is {kind}, whose tasks "
            f"are {list(tasks)}"
        )

    def _check_dimensions(self, params: PoolingParams) -> None:
        dims = params.dimensions
        if dims is None:
            return
        if not self.pooler.matryoshka:
            name = self.config.model_config.served_model_names[0]
            raise ValueError(
                f'Model "{name}" does not support matryoshka representation, changing '
                "output dimensions will lead to poor results."
            )
        if dims > self.model_config.hidden_size:
            raise ValueError(
                f"dimensions {dims} is larger than the model's {self.model_config.hidden_size}"
            )

    def add_lora(self, lora_request: Any) -> bool:
        """Reads and checks a LoRA adapter onto the host (`LoRAAdapterError`, a
        ValueError, when it cannot be served); False when its id is known already."""
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter; False when the id is unknown."""
        return self.executor.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters added."""
        return self.executor.list_loras()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> None:
        """Validates and queues a request; raises ValueError (nothing queued) if bad."""
        prepared = self.prepare(prompt, params, lora_request)
        self.add_prepared(request_id, prepared, arrival_time=arrival_time, priority=priority)

    def add_prepared(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a prompt that `prepare` accepted (one sequence per ``n``); refused
        while the engine sleeps (`EngineSleepingError`)."""
        self.rollout.check_awake()
        if request_id in self.outputs.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids, params, lora = prepared[:4]
        arrival = time.time() if arrival_time is None else arrival_time
        child_ids = self.outputs.add(request_id, text, ids, params, arrival, lora)
        for index, child in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + index
            request = Request(
                child,
                ids,
                child_params,
                priority=priority,
                eos_token_id=self.eos_token_id,
                lora_request=lora,
                mm_items=prepared.mm_items,
            )
            # custom logits processors may read every request's outputs on the host, the
            # thinking budget those of the requests that name one
            request.needs_known_outputs |= bool(self.logits_processors) or (
                requested_budget(params) is not None
            )
            self.scheduler.add_request(request)

    def _prepare_params(self, params: SamplingParams, num_prompt: int) -> SamplingParams:
        params = params.clone()
        params.verify_against(self.config.model_config.max_logprobs, self.vocab_size)
        validate_request(self.logits_processors, params)
        self.thinking_budget.check(params)
        if params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError(
                    "structured outputs need a tokenizer (--skip-tokenizer-init is set)"
                )
            self.structured_outputs.validate(params)
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        if params.max_tokens is None:
            params.max_tokens = max(self.max_model_len - num_prompt, 1)
        cap = self.generation_config.get("max_new_tokens")  # vLLM's max_tokens default
        if cap:  # (--override-generation-config '{"max_new_tokens": N}' sets one too)
            params.max_tokens = min(params.max_tokens, cap)
        return params

    def _check_prompt(self, ids: list[int], params: SamplingParams | None) -> None:
        """Checks the prompt's ids and length (with ``params`` None: a pooling
        request's, which generates nothing)."""
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's wording
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size})"
            )
        if params is None:
            if len(ids) > self.max_model_len:
                raise PromptTooLongError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {len(ids)} tokens in the input for embedding "
                    "generation. Please reduce the length of the input."
                )
            return
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
                f"messages, {params.max_tokens} in the completion). Please reduce the length "
                "of the messages or completion."
            )

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Aborts requests in any state; frees their pages now."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        children = [c for rid in ids for c in self.outputs.abort(rid)]
        self.scheduler.abort_requests(children)

    def abort_all(self) -> list[RequestOutput]:
        """Aborts every request; each one's last output, finished with reason
        ``abort`` (`AsyncLLM.pause_generation("abort")`)."""
        outputs, children, now = [], [], time.time()
        for request_id in list(self.outputs.requests):
            ids, output = self.outputs.abort_with_output(request_id, now)
            children += ids
            if output is not None:
                outputs.append(output)
        self.scheduler.abort_requests(children)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs its requests' kinds ask for
        (with async scheduling: dispatches the next step, then returns the outputs of
        the one before)."""
        if not self.async_scheduling:
            sched_out = self._schedule()
            return self._update(sched_out, self.executor.execute(sched_out))
        outputs = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self.scheduler.needs_known_outputs():
            outputs += self._update(previous[0], previous[1].result())
            previous = None
        sched_out = self._schedule()
        self._in_flight = (sched_out, self.executor.submit(sched_out))
        if previous is not None:
            outputs += self._update(previous[0], previous[1].result())
        if sched_out.is_empty:
            current, self._in_flight = self._in_flight, None
            outputs += self._update(current[0], current[1].result())
        return outputs

    def _schedule(self) -> SchedulerOutput:
        sched_out = self.scheduler.schedule()
        if sched_out.scheduled_new_reqs:
            self.outputs.mark_scheduled(
                (r.req_id for r in sched_out.scheduled_new_reqs), time.time()
            )
        if sched_out.preempted_req_ids:
            self.outputs.mark_preempted(sched_out.preempted_req_ids)
        return sched_out

    def _update(self, sched_out: SchedulerOutput, runner_out) -> list[RequestOutput]:
        core_outputs = self.scheduler.update(sched_out, runner_out)
        outputs, stops = self.outputs.process(core_outputs)
        for child, stop in stops:
            self.scheduler.finish_requests(child, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        return outputs

    def get_stats(self):
        """The scheduler's snapshot (`SchedulerStats`): queues, KV usage, counters,
        and the executor's sleep level."""
        stats = self.scheduler.get_stats()
        return dataclasses.replace(stats, sleep_level=self.executor.sleep_level)

    def take_iteration_stats(self):
        """Token and latency statistics (`IterationStats`) since the last call."""
        return self.outputs.take_stats()

    def shutdown(self) -> None:
        """Aborts what is in flight, stops the executor's workers and releases its
        device buffers (parameters, KV cache). Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._in_flight is not None:  # its buffers must not be deleted under it
            self._in_flight[1].result()
            self._in_flight = None
        self.abort_request(list(self.outputs.requests))
        self.executor.shutdown()
        if self.structured_outputs is not None:
            self.structured_outputs.close()
