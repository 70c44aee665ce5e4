"""Beam search on /v1/completions and /v1/chat/completions (vLLM's ``use_beam_search``).

As in vLLM, ``n`` is the beam width and the ``n`` choices of a prompt are its beams,
best first; ``length_penalty``, ``ignore_eos``, ``include_stop_str_in_output`` and
``temperature`` go to `BeamSearchParams`, and ``early_stopping`` (transformers' and
vLLM v0's rule, default False) too. The search itself is the engine client's
(`EngineClient.beam_search`: one request per live beam and step, routed like any
other, so one engine and data-parallel replicas behave the same); its selection rules
are transformers' (`jaxengine.beam_search`).

Each prompt's search ends in one final output holding all its beams, which the
handlers turn into choices as they do for sampled outputs. Completions refuse
``stream`` with beam search, as vLLM ("Streaming is not currently supported with beam
search"); a chat stream sends each beam in one chunk when its search ends, as vLLM's
does. Fields that steer sampling (penalties, top-p/k/min-p, stop strings, logit bias,
structured outputs, prompt logprobs, ...) mean nothing to beam search: vLLM ignores
them there, jaxengine refuses them (400, naming the field).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxengine.beam_search import BeamSearchParams
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import RequestOutput
from server.completions.protocol import CompletionRequest
from server.errors import APIError
from server.serving import ServingContext, merge_async_iterators


def _unset(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in neutral


SAMPLING_ONLY: dict[str, Callable[[Any], bool]] = {
    "stop": _unset("", []),
    "stop_token_ids": _unset([]),
    "bad_words": _unset([]),
    "presence_penalty": _unset(0.0),
    "frequency_penalty": _unset(0.0),
    "repetition_penalty": _unset(1.0),
    "top_p": _unset(1.0),
    "top_k": _unset(0, -1),
    "min_p": _unset(0.0),
    "min_tokens": _unset(0),
    "logit_bias": _unset({}),
    "allowed_token_ids": _unset(),
    "logprob_token_ids": _unset(),
}
"""Request fields that steer sampling: a value that asks for something is refused
with beam search."""


def streams(
    ctx: ServingContext, request: Any, request_id: str, prepared: Sequence[PreparedPrompt]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The request's outputs by prompt index: its engine requests' streams, or with
    ``use_beam_search`` each prompt's final beam-search output (its ``n`` beams);
    logged with ``--enable-log-outputs``. Raises `APIError` / ValueError (nothing
    queued) for what beam search refuses."""
    if not getattr(request, "use_beam_search", False):
        merged = ctx.streams(request_id, prepared, request.priority)
    else:
        merged = _beam_streams(ctx, request, request_id, prepared)
    return ctx.log_outputs(request_id, prepared, merged)


def _beam_streams(
    ctx: ServingContext, request: Any, request_id: str, prepared: Sequence[PreparedPrompt]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    check_beam_request(request, prepared)
    ctx.check_admission(prepared)  # each step's requests are checked again as they arrive
    iterators = [
        ctx.engine.beam_search(
            p,
            beam_search_params(request, p),
            f"{request_id}-{i}",
            priority=request.priority,
            logprobs=p.params.logprobs,
            skip_special_tokens=request.skip_special_tokens,
        )
        for i, p in enumerate(prepared)
    ]
    return merge_async_iterators(iterators)


def beam_search_params(request: Any, prepared: PreparedPrompt) -> BeamSearchParams:
    """vLLM's ``to_beam_search_params``: the prepared prompt's ``max_tokens`` (the
    request's, or what the context leaves) and temperature (the request's or the
    model's default)."""
    return BeamSearchParams(
        beam_width=request.n,
        max_tokens=prepared.params.max_tokens,
        ignore_eos=request.ignore_eos,
        temperature=prepared.params.temperature,
        length_penalty=request.length_penalty,
        include_stop_str_in_output=request.include_stop_str_in_output,
        early_stopping=request.early_stopping,
    )


def check_beam_request(request: Any, prepared: Sequence[PreparedPrompt]) -> None:
    """Refuses (400) what beam search does not run: streaming completions, and the
    fields that steer sampling."""
    if isinstance(request, CompletionRequest) and request.stream:
        raise APIError("Streaming is not currently supported with beam search", param="stream")
    for name, asks in SAMPLING_ONLY.items():
        if asks(getattr(request, name, None)):
            raise APIError(f"{name} is not supported with beam search", param=name)
    params = prepared[0].params
    if params.prompt_logprobs is not None:
        raise APIError(
            "prompt logprobs (prompt_logprobs, or echo with logprobs) are not supported "
            "with beam search",
            param="prompt_logprobs",
        )
    if params.structured_outputs is not None:
        raise APIError(
            "structured outputs (response_format, structured_outputs, guided_*, a "
            "required or named tool_choice) are not supported with beam search",
            param="use_beam_search",
        )
