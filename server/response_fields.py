"""Response pieces in OpenAI's formats: logprobs (completions and chat), usage, and
vLLM's per-request timing ``metrics``.

Logprobs come from the engine as vLLM does: one ``{token_id: Logprob}`` dict per
position, the sampled token first, then the top-k by rank (or the request's
``logprob_token_ids``). Token strings are the decoded tokens, or ``"token_id:<id>"``
with ``return_tokens_as_token_ids``.

``top_n`` says which entries of a position are shown: those of rank <= ``top_n``
(and the sampled token, in completions), every entry for -1 (the whole vocabulary),
or every entry in the engine's order for None (``logprob_token_ids``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxengine.outputs import Logprob, RequestMetrics


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_text(token_id: int, lp: Logprob | None, tokenizer: Any, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _finite(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def _shows(lp: Logprob, top_n: int | None) -> bool:
    """Whether ``top_n`` shows an entry (see the module docstring)."""
    return top_n is None or top_n < 0 or lp.rank is not None and lp.rank <= top_n


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    top_n: int | None,
    tokenizer: Any,
    as_ids: bool,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The completions format: parallel lists of tokens, logprobs, top dicts, offsets."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        own = entry.get(token_id) if entry else None
        text = token_text(token_id, own, tokenizer, as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(own.logprob) if own else None)
        top = {
            token_text(t, lp, tokenizer, as_ids): _finite(lp.logprob)
            for t, lp in entry.items()
            if _shows(lp, top_n) or t == token_id
        }
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    top_n: int | None,
    tokenizer: Any,
    as_ids: bool,
) -> dict[str, Any]:
    """The chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        entry = entry or {}
        own = entry.get(token_id)
        text = token_text(token_id, own, tokenizer, as_ids)
        top = [(t, lp) for t, lp in entry.items() if _shows(lp, top_n)]
        if top_n is not None:
            top.sort(key=lambda item: item[1].rank or 0)
        content.append(
            {
                "token": text,
                "logprob": _finite(own.logprob) if own else -9999.0,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (s := token_text(t, lp, tokenizer, as_ids)),
                        "logprob": _finite(lp.logprob),
                        "bytes": list(s.encode("utf-8")),
                    }
                    for t, lp in top
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(entries: Sequence[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first: nothing predicts
    it) or ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, the prompt token
    first, then the top-k."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """OpenAI's usage block; ``cached`` (or None to leave out the details)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


METRICS_FIELDS = (
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
)


def per_request_metrics(
    metrics: RequestMetrics | None, num_generation_tokens: int
) -> dict[str, float | None]:
    """vLLM's per-request timing ``metrics`` (``--enable-per-request-metrics``) from
    the engine's timestamps, each field None when a timestamp it needs is missing:

    - ``time_to_first_token_ms``: first schedule -> first output token;
    - ``generation_time_ms``: first -> last output token (decode only);
    - ``queue_time_ms``: arrival in the engine -> first schedule;
    - ``mean_itl_ms``: the decode time over the tokens after the first (None for
      fewer than two tokens);
    - ``tokens_per_second``: every generated token over first schedule -> last token
      (prefill included).
    """
    out: dict[str, float | None] = dict.fromkeys(METRICS_FIELDS)
    if metrics is None:
        return out
    scheduled, first = metrics.first_scheduled_time, metrics.first_token_time
    last = metrics.last_token_time if first is not None else None  # no token yet
    if scheduled is not None:
        out["queue_time_ms"] = (scheduled - metrics.arrival_time) * 1000
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
        if num_generation_tokens > 1:
            out["mean_itl_ms"] = (last - first) / (num_generation_tokens - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = num_generation_tokens / (last - scheduled)
    return out
