"""`LLM`: offline batched generation, vLLM's Python API.

``LLM(model=..., **engine_args).generate(prompts, sampling_params)`` queues every
prompt, steps the engine until all finish, and returns `RequestOutput`s in input
order. Every prompt is validated before any is queued, so one bad prompt raises a
`ValueError` and leaves nothing half-done.

With ``data_parallel_size=N`` the engine is a `DataParallelEngine`: N replicas, each
on its own devices; requests are spread over them by load and prefix affinity, and
every step steps all busy replicas at once.

An engine's lifetime is explicit: ``llm.shutdown()``, ``with LLM(...) as llm:``, or
garbage collection releases its device memory, so a notebook can build engine after
engine in one process.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jaxengine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    check_engine,
    eos_token_ids,
    run_beam_searches,
)
from jaxengine.engine_args import EngineArgs
from jaxengine.lora import LoRARequest
from jaxengine.metrics.reader import Metric, get_metrics_snapshot
from jaxengine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxengine.pooling_params import (
    PoolingParams,
    bi_encoder,
    cosine_similarity,
    pair_prompt,
    score_pairs,
    unique_texts,
)
from jaxengine.sampling_params import RequestOutputKind, SamplingParams

PromptLike = str | dict | Sequence[int]


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    return prompts


def _pooling_request(params: PoolingParams, truncate: int | None, task: str | None):
    """``params`` with the call's truncation and task (a copy when they change it)."""
    if truncate is None and task is None:
        return params
    params = params.clone()
    if truncate is not None:
        params.truncate_prompt_tokens = truncate
    if task is not None:
        params.task = task
    params.__post_init__()
    return params


def _per_prompt(value: Any, count: int, what: str) -> list:
    """``value`` for each of ``count`` prompts: one value for all, or a list of one each."""
    if value is None or not isinstance(value, Sequence):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{len(value)} {what} for {count} prompts: give one or one each")
    return list(value)


class LLM:
    """An engine for offline inference, built from vLLM-named engine arguments."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from jaxengine.entrypoints.factory import offline_engine

        if model is not None:
            kwargs["model"] = model
        log_stats = not kwargs.pop("disable_log_stats", True)
        args = EngineArgs(**kwargs)
        # an LLMEngine, or N of them behind the same interface with data_parallel_size=N
        self.engine, self._stats = offline_engine(args, log_stats)
        self._ids = itertools.count()
        # garbage collection shuts the engine down too (a notebook's `del llm`)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks an adapter ahead of its first request (`LLMEngine.add_lora`)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    # RL rollouts (`engine.rollout`): vLLM's calls, between `generate` calls

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache and parks the weights in host memory (level 1) or drops
        them (level 2, to be written by `update_weights`); needs enable_sleep_mode."""
        self.engine.rollout.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores ``tags`` ("weights", "kv_cache"; default both)."""
        self.engine.rollout.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.rollout.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.engine.rollout.reset_prefix_cache()

    def update_weights(self, weights: Any) -> int:
        """Writes ``{hf_name: array}`` (or pairs) into the engine, all or nothing;
        arrays may be numpy, torch, or `jax.Array`s (resharded on device)."""
        return self.engine.rollout.update_weights(weights)

    def reload_weights(self, path: str | None = None) -> int:
        """Reads the checkpoint again (or the one at ``path``) into the engine."""
        return self.engine.rollout.reload_weights(path)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.engine.rollout.collective_rpc(method, args, kwargs)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (those the server's ``/metrics`` has, by the same
        names) as `Counter`, `Gauge`, `Histogram` and `Vector` records. Needs
        ``LLM(..., disable_log_stats=False)``, as vLLM."""
        if self._stats is None:
            raise RuntimeError("Stat logging disabled: build the LLM with disable_log_stats=False")
        return get_metrics_snapshot(self._stats.registry)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Ends the engine's lifetime: stops its threads, disarms its compile guard and
        releases its device buffers (parameters, KV cache; every replica's).
        Idempotent; the `LLM` cannot generate after it."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for ``prompts`` (texts, token-id lists or dicts);
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None:
        the base model; needs ``enable_lora=True``)."""
        prompt_list = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        loras = _per_prompt(lora_request, len(prompt_list), "LoRA requests")
        return self._run(prompt_list, params, use_tqdm, priority, loras)

    def encode(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Runs ``prompts`` through a pooling model (``--runner pooling``): each
        result's ``outputs.data`` is its pooled vector, or with ``pooling_task``
        "token_embed" one vector per prompt token."""
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params or PoolingParams(), len(prompt_list), "pooling params")
        params = [_pooling_request(p, truncate_prompt_tokens, pooling_task) for p in params]
        loras = _per_prompt(lora_request, len(prompt_list), "LoRA requests")
        return self._run(prompt_list, params, use_tqdm, None, loras)

    def embed(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats)."""
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A classification model's label probabilities per prompt (``outputs.probs``)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="classify")  # fmt: skip
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """A reward model's (``--convert reward``) output per prompt token
        (``outputs.data`` ``[tokens, H]``); a classifier's probabilities per token."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="token_classify")  # fmt: skip

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair: one ``data_1`` against every
        ``data_2``, or the two lists pairwise. An embedding model scores as a
        bi-encoder: the cosine similarity of the two texts' embeddings (vLLM's)."""
        pairs = score_pairs(data_1, data_2)
        if bi_encoder(self.engine.pooler):
            return self._embedding_scores(pairs, truncate_prompt_tokens, use_tqdm, pooling_params)
        prompts = [pair_prompt(self.engine.tokenizer, a, b) for a, b in pairs]
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, pooling_task="score")  # fmt: skip
        return [ScoringRequestOutput.from_base(o) for o in outs]

    def _embedding_scores(self, pairs, truncate, use_tqdm, pooling_params):
        """A bi-encoder's scores: each text embedded once, each pair's cosine."""
        texts = unique_texts(pairs)
        outs = self.embed(texts, truncate_prompt_tokens=truncate, use_tqdm=use_tqdm,
                          pooling_params=pooling_params)  # fmt: skip
        by_text = dict(zip(texts, outs, strict=True))
        scores = []
        for a, b in pairs:
            first, second = by_text[a], by_text[b]
            score = cosine_similarity(first.outputs.embedding, second.outputs.embedding)
            scores.append(ScoringRequestOutput(
                f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                first.prompt_token_ids + second.prompt_token_ids,
            ))  # fmt: skip
        return scores

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of conversations.

        ``tools`` (OpenAI's function definitions) are given to the chat template, as
        in vLLM; the reply is text (parse tool calls from it, or constrain it with
        `SamplingParams(structured_outputs=...)`). Images come as ``image_url`` parts
        (data:, file:// under ``allowed_local_media_path``, http) or vLLM's
        ``{"type": "image_pil", "image_pil": image}`` (`multimodal.chat`).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template_kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            template_kwargs["tools"] = tools
        template_kwargs.update(
            chat_template=chat_template or self.engine.config.model_config.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        prompts = [self._chat_prompt(c, template_kwargs) for c in conversations]
        params = self._params_list(sampling_params, len(prompts))
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        return self._run(prompts, params, use_tqdm, None, loras)

    def _chat_prompt(self, conversation: list[dict], template_kwargs: dict) -> dict:
        """A conversation's engine prompt: its token ids, or with images its text
        (special tokens already rendered) and its images."""
        from jaxengine.multimodal.chat import conversation_images, has_images
        from jaxengine.tokenizer import apply_chat_template

        tokenizer = self.engine.tokenizer
        if not has_images(conversation):
            ids = apply_chat_template(tokenizer, conversation, **template_kwargs)
            return {"prompt_token_ids": ids}
        from jaxengine.multimodal.media import media_settings

        settings = media_settings(self.engine.config.multimodal_config)
        messages, images = conversation_images(conversation, settings)
        text = apply_chat_template(tokenizer, messages, tokenize=False, **template_kwargs)
        return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}

    def beam_search(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's API, transformers' selection rules:
        `jaxengine.beam_search`): per prompt, its best ``params.beam_width``
        sequences, best first, whose ``tokens`` start with the prompt's and whose
        ``text`` decodes them all. Each step is one engine request per live beam,
        whose full pages come from the prefix cache. Every prompt is validated
        before any runs; ``concurrency_limit`` prompts are searched at a time (all
        by default)."""
        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompt_list), "LoRA requests")
        pairs = zip(prompt_list, loras, strict=True)
        searches = [self._beam_search_of(prompt, params, lora) for prompt, lora in pairs]
        limit = concurrency_limit or max(len(searches), 1)
        groups = [searches[i : i + limit] for i in range(0, len(searches), limit)]
        bar = tqdm(total=len(groups) * params.max_tokens, desc="Beam search", disable=not use_tqdm)
        try:
            for group in groups:
                run_beam_searches(group, self._score_beams, on_step=lambda: bar.update(1))
        finally:
            bar.close()
        tokenizer = self.engine.tokenizer
        decode = tokenizer.decode if tokenizer is not None else None
        return [search.output(decode) for search in searches]

    # ------------------------------------------------------------------ details

    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        return _per_prompt(sampling_params, count, "sampling params")

    def _beam_search_of(self, prompt, params: BeamSearchParams, lora) -> BeamSearch:
        """A prompt's search, after the checks a generation of ``max_tokens`` gets."""
        engine = self.engine
        prepared = engine.prepare(prompt, SamplingParams(max_tokens=params.max_tokens), lora)
        eos = eos_token_ids(engine.eos_token_id, engine.generation_config)
        search = BeamSearch(prepared.token_ids, params, eos, prepared.lora_request)
        check_engine(search, engine.config.model_config)
        return search

    def _score_beams(self, batch) -> list:
        """One step of beam search: each (search, token ids)'s next-token logprobs."""
        prompts = [{"prompt_token_ids": ids} for _, ids in batch]
        params = [search.step_params() for search, _ in batch]
        loras = [search.lora_request for search, _ in batch]
        outputs = self._run(prompts, params, False, None, loras)
        return [out.outputs[0].logprobs[0] for out in outputs]

    def _run(self, prompts, params, use_tqdm, priority, loras=None) -> list[RequestOutput]:
        engine = self.engine
        prepared = []  # validate every prompt before queueing any
        loras = loras or [None] * len(prompts)
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            prepared.append(engine.prepare(prompt, p, lora))
        ids = []
        try:
            for i, ready in enumerate(prepared):
                request_id = str(next(self._ids))
                engine.add_prepared(request_id, ready, priority=priority[i] if priority else 0)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(results) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                self._record_stats()
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def _record_stats(self) -> None:
        if self._stats is None:
            return
        for i, replica in enumerate(getattr(self.engine, "replicas", [self.engine])):
            self._stats.record(replica.get_stats(), replica.take_iteration_stats(), i)
