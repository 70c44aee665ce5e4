"""Response pieces in OpenAI's formats: logprobs (completions and chat) and usage.

Logprobs come from the engine as vLLM does: one ``{token_id: Logprob}`` dict per
position, the sampled token first, then the top-k by rank. Token strings are the
decoded tokens, or ``"token_id:<id>"`` with ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxengine.outputs import Logprob


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


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    top_n: int,
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
            if lp.rank is not None and lp.rank <= top_n or t == token_id
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
    top_n: int,
    tokenizer: Any,
    as_ids: bool,
) -> dict[str, Any]:
    """The chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        entry = entry or {}
        own = entry.get(token_id)
        text = token_text(token_id, own, tokenizer, as_ids)
        top = sorted(
            ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda item: item[1].rank,
        )
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
