"""What the API server needs of an engine: the `EngineClient` protocol.

Implemented by `AsyncLLM` (one engine, `entrypoints.async_llm`) and `DPAsyncLLM`
(data-parallel replicas used as one, `entrypoints.dp_async_llm`); the server
(`server/`) types its engine as an `EngineClient` and knows neither. A replica
behind `DPAsyncLLM` is a `ReplicaClient`, the subset that makes sense for one
replica: an `AsyncLLM` on this node or a `RemoteReplica` on another
(`entrypoints.dp_remote`).

`EngineFront` holds what both async fronts do the same way (prompt preparation,
LoRA adapters, admission control: `entrypoints.admission`).
`dp_async_llm.async_engine` (and `async_engine_from_args`) build the right client for
a config. This module imports no implementation, so every one of them can import it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jaxengine.beam_search import BeamSearch, BeamSearchParams, check_engine, eos_token_ids

if TYPE_CHECKING:
    from jaxengine.config import EngineConfig
    from jaxengine.core.sched_output import SchedulerStats
    from jaxengine.engine.protocol import Engine
    from jaxengine.entrypoints.admission import AdmissionControl
    from jaxengine.entrypoints.streams import StreamTable
    from jaxengine.inputs import PreparedPrompt
    from jaxengine.metrics.stats import IterationStats
    from jaxengine.outputs import RequestOutput
    from jaxengine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine (or a data-parallel replica) stopped after an error; the server must
    be restarted."""


class EngineDrainingError(RuntimeError):
    """The engine (or a data-parallel node) is shutting down and takes no new request;
    the server answers 503: retry on another replica."""


class EngineFront:
    """What both async fronts (`AsyncLLM`, `DPAsyncLLM`) ask of their ``engine`` (an
    `LLMEngine` or `DataParallelEngine`) outside its thread: the model's limits,
    preparing prompts and LoRA adapters; and admission control over its ``streams``."""

    engine: Engine
    streams: StreamTable
    admission: AdmissionControl | None
    """The caps this front checks when a request arrives (None: a replica behind a
    front that checks them for all its replicas)."""

    def check_admission(self, seqs: int = 1) -> None:
        """Raises `AdmissionRejectedError` (and counts it) when a request of ``seqs``
        sequences would go over ``--max-num-queued-reqs`` or ``--max-num-queued-tokens``
        now (vLLM's ``AsyncLLM.check_admission``). `generate` checks each request as
        it arrives; the server also checks before it starts a response, so that a
        refused stream is a 503 rather than an error event."""
        if self.admission is not None:
            self.admission.check(self.streams.load(), seqs)

    def admission_rejections(self) -> dict[str, int]:
        """Requests refused by admission control, by reason (empty for a replica)."""
        return {} if self.admission is None else self.admission.rejections()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def pooler(self) -> Any:
        return self.engine.pooler

    @property
    def generation_config(self) -> dict[str, Any] | None:
        return self.engine.generation_config

    @property
    def takes_images(self) -> bool:
        """Whether the model takes images (a vision-language model)."""
        return getattr(self.engine, "images", None) is not None

    def prepare(
        self, prompt: Any, params: SamplingParams, lora_request: Any = None
    ) -> PreparedPrompt:
        """Tokenizes and validates, and reads the LoRA adapter if one is given (raises
        ValueError, nothing queued)."""
        return self.engine.prepare(prompt, params, lora_request)

    async def add_lora(self, lora_request: Any) -> bool:
        """Reads and checks an adapter (off the event loop; `LLMEngine.add_lora`)."""
        return await asyncio.to_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await asyncio.to_thread(self.engine.remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def beam_search(
        self,
        prompt: PreparedPrompt,
        params: BeamSearchParams,
        request_id: str,
        *,
        priority: int = 0,
        logprobs: int | None = None,
        skip_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """A prepared prompt's beam search (`jaxengine.beam_search`): one final
        `RequestOutput` with its ``beam_width`` sequences, best first (their
        ``logprobs`` when ``logprobs`` is given). Each step runs one ``generate``
        request per live beam, ``{request_id}-s{step}-b{beam}``, wherever
        ``generate`` routes it; leaving early aborts them. Raises ValueError at once
        (nothing queued) when the engine cannot score the search (`check_engine`)."""
        engine = self.engine
        eos = eos_token_ids(engine.eos_token_id, engine.generation_config)
        search = BeamSearch(prompt.token_ids, params, eos, prompt.lora_request)
        check_engine(search, engine.config.model_config)
        tokenizer = engine.tokenizer

        def decode(ids: list[int]) -> str:
            if tokenizer is None:
                return ""
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        return self._beam_search(search, prompt.text, request_id, priority, logprobs, decode)

    async def _beam_search(
        self, search: BeamSearch, text, request_id, priority, logprobs, decode
    ) -> AsyncIterator[RequestOutput]:
        step_params = search.step_params(logprobs)
        for number in itertools.count():
            beams = search.live()
            if not beams:
                break
            request_ids = [f"{request_id}-s{number}-b{j}" for j in range(len(beams))]
            tasks = [
                asyncio.ensure_future(self._beam_step(b, step_params, search, rid, priority))
                for b, rid in zip(beams, request_ids, strict=True)
            ]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # after a failure: the other beams' requests abort
                    task.cancel()
            search.advance(results)
        yield search.request_output(request_id, text, decode, logprobs is not None)

    async def _beam_step(self, ids, params, search, request_id, priority) -> Any:
        """One beam's next-token logprobs: a one-token request of its tokens."""
        prepared = self.prepare({"prompt_token_ids": ids}, params, search.lora_request)
        stream = self.generate(prepared, prepared.params, request_id, priority=priority)
        last = None
        try:
            async for out in stream:
                last = out
        finally:
            await stream.aclose()
        return last.outputs[0].logprobs[0]


class StatLogger(Protocol):
    """Receives each engine step's stats (`jaxengine.metrics`); must be thread-safe."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class ReplicaClient(Protocol):
    """One data-parallel replica, as `DPAsyncLLM` drives it.

    ``generate`` takes a prompt already prepared by the front. Its streams live in
    the front's shared `StreamTable` with owner ``rank``.
    """

    rank: int

    @property
    def is_running(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    def num_requests(self) -> int: ...

    async def check_health(self) -> None: ...

    def generate(
        self,
        prompt: PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str | Sequence[str]) -> None: ...

    async def abort_all(self) -> None: ...

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None: ...


class EngineClient(Protocol):
    """The engine as the API server uses it.

    Invariants: `prepare` raises ValueError (nothing queued) for a bad prompt;
    `generate` streams a request's outputs until one is ``finished``, and leaving it
    early aborts the request; after an engine failure, streams and new requests get
    `EngineDeadError`, `check_health` raises it and ``errored`` is true.
    """

    @property
    def config(self) -> EngineConfig:
        """The resolved engine config (``max_model_len`` and ``block_size`` set)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (None with ``--skip-tokenizer-init``)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def pooler(self) -> Any:
        """A pooling model's pooler (`runner.pooler.PoolerSettings`), None for a
        generating one."""
        ...

    @property
    def generation_config(self) -> dict[str, Any] | None:
        """The model's ``generation_config.json`` defaults (None when it has none)."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    def num_requests(self) -> int:
        """Requests in flight (queued or running)."""
        ...

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when the engine cannot serve."""
        ...

    def check_admission(self, seqs: int = 1) -> None:
        """Raises `AdmissionRejectedError` when a request of ``seqs`` sequences would
        go over an admission cap now (`entrypoints.admission`); counts it."""
        ...

    def admission_rejections(self) -> dict[str, int]:
        """Requests refused by admission control so far, by reason (each at 0 from
        the start): vLLM's ``admission_rejections_total``."""
        ...

    def prepare(
        self, prompt: Any, params: SamplingParams, lora_request: Any = None
    ) -> PreparedPrompt:
        """Tokenizes and validates, and reads the `LoRARequest`'s adapter if one is
        given (raises ValueError, nothing queued)."""
        ...

    async def add_lora(self, lora_request: Any) -> bool:
        """Reads and checks an adapter (`LoRAAdapterError`); False if already added."""
        ...

    async def remove_lora(self, lora_id: int) -> bool: ...

    async def list_loras(self) -> set[int]: ...

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; ``prompt`` may be a `PreparedPrompt`. Raises
        `AdmissionRejectedError` as it arrives when it goes over an admission cap."""
        ...

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests in any state (unknown ids are ignored)."""
        ...

    async def abort_all(self) -> None:
        """Aborts every request in flight: each stream ends with a last output
        finished with reason ``abort`` (the server's drain, `server/api_server/drain.py`)."""
        ...

    def beam_search(
        self,
        prompt: PreparedPrompt,
        params: BeamSearchParams,
        request_id: str,
        *,
        priority: int = 0,
        logprobs: int | None = None,
        skip_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """A prepared prompt's beam search: one final `RequestOutput` holding its
        sequences, best first (`EngineFront.beam_search`)."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """Whether any replica's weights or KV cache sleep (`engine.rollout`)."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stops stepping: ``abort``, ``wait`` for or ``keep`` the unfinished requests
        (`entrypoints.pausing`)."""
        ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """A rollout call (sleep, wake_up, update_weights, reload_weights, ...) on every
        replica between steps; one result each."""
        ...

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stops the engine threads and (unless told not to) releases the engine."""
        ...
