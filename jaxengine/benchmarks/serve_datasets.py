"""Workloads of the serving benchmark (`benchmarks.serve`): prompts and their arrival times.

Two datasets, as in vLLM's ``bench serve``:

- ``random``: prompts of random text. Random ids from the tokenizer's ordinary (not
  special, not added) tokens are decoded, re-encoded and cut to the wanted length; the
  re-encoded length is what gets recorded. Sending the ids themselves as a token-id
  prompt would hit the length exactly, but only on ``/v1/completions``; text works on
  both endpoints, goes through the server's tokenizer like real traffic, and keeps the
  results comparable with vLLM's. An optional shared random prefix makes a
  prefix-caching workload.
- ``sharegpt``: the first human turn of each conversation of a ShareGPT JSON file as the
  prompt, the token count of the gpt reply after it as the output length, with vLLM's
  length filter.

Arrivals form a gamma process (a Poisson process at burstiness 1). Everything here is
pure and seeded; a tokenizer is any object with ``encode(text, add_special_tokens=)``,
``decode(ids)`` and ``len()``, like a ``transformers`` tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxengine.benchmarks.common import log

SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    """Prompt tokens by the client's tokenizer (the server's count replaces it if sent)."""
    expected_output_len: int
    """``max_tokens`` of the request."""


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """[floor(length * (1 - r)), ceil(length * (1 + r))], at least 1 (vLLM's rule)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    return low, max(low, math.ceil(length * (1 + range_ratio)))


def vocab_pool(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's ordinary tokens: no special or added tokens."""
    skip = set(getattr(tokenizer, "all_special_ids", []) or [])
    skip |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(len(tokenizer)) if i not in skip]


def sample_random(
    tokenizer: Any,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num`` random-text prompts (see the module docstring), reproducible from ``seed``.

    Prompt lengths are drawn from ``length_range(input_len, range_ratio)`` plus
    ``prefix_len`` shared tokens, output lengths from ``length_range(output_len, ...)``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray(vocab_pool(tokenizer))
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num)
    output_lens = rng.integers(out_low, out_high + 1, size=num)
    prefix = rng.choice(pool, size=max(0, prefix_len)).tolist()
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = prefix + rng.choice(pool, size=n_in).tolist()
        text = tokenizer.decode(ids)
        # Decoding then encoding need not give the same ids back: keep at most the
        # wanted number and record what the text really holds.
        ids = tokenizer.encode(text, add_special_tokens=False)[: len(prefix) + n_in]
        requests.append(SampleRequest(tokenizer.decode(ids), len(ids), n_out))
    return requests


def sharegpt_pairs(data: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply after it) of each ShareGPT conversation."""
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or []
        ask = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if ask is None:
            continue
        reply = next((t for t in turns[ask + 1 :] if t.get("from") == "gpt"), None)
        if reply is not None:
            pairs.append((turns[ask]["value"], reply["value"]))
    return pairs


def keep_sharegpt_pair(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's filter: no prompt (or reply) under 4 tokens, prompt <= 1024, sum <= 2048."""
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and (
        prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
    )


def sample_sharegpt(
    path: str | os.PathLike,
    tokenizer: Any,
    num: int,
    seed: int = 0,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """``num`` requests from a ShareGPT file, shuffled by ``seed``; repeats if too few.

    The file is a JSON list of ``{"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}``. ``output_len`` fixes every request's output
    length instead of the reply's. Raises ValueError (or OSError) on an unusable file.
    """
    data = json.loads(Path(path).read_text())
    pairs = sharegpt_pairs(data if isinstance(data, list) else [])
    rng = random.Random(seed)
    rng.shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if keep_sharegpt_pair(prompt_len, out_len, output_len is not None):
            requests.append(SampleRequest(prompt, prompt_len, out_len))
    if not requests:
        raise ValueError(f"{path}: no usable conversation (human turn then gpt reply)")
    if len(requests) < num:
        log(f"only {len(requests)} usable conversations: repeating some to send {num}")
        requests += rng.choices(requests, k=num - len(requests))
    return requests


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times in seconds from the start: 0, then gamma(burstiness)-distributed gaps.

    The gaps have mean 1 / request_rate; burstiness 1 makes them exponential (a
    Poisson process), smaller values burstier, larger ones more regular.
    """
    if math.isinf(request_rate) or num == 0:
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
