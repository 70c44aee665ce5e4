"""The HTTP side of the serving benchmark (`jaxengine.benchmarks.serve`): streamed requests, timed.

One request is a ``POST`` with ``"stream": true`` and ``stream_options.include_usage``,
answered with server-sent events: ``data: {json}`` lines until ``data: [DONE]``. The
client times, per request: the first chunk carrying text (TTFT), the gaps between
later text chunks (ITL; a chunk holding several tokens counts as one gap, as in vLLM),
and the end of the stream (E2EL). Token counts come from the usage chunk. Failures
(HTTP errors, error events, broken streams) are recorded in the result, never raised,
so that one bad request does not end a benchmark.

httpx is imported inside the functions; the client is an ``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from jaxengine.benchmarks.serve_datasets import SampleRequest

DONE = "[DONE]"


@dataclass
class RequestResult:
    """What one request measured (times in seconds)."""

    prompt_len: int
    """Prompt tokens: the server's count from the usage chunk, else the client's."""
    success: bool = False
    output_tokens: int | None = None
    """From the usage chunk; None until counted."""
    ttft: float | None = None
    """None when no chunk carried text."""
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    """End to end: from sending to the end of the stream."""
    text: str = ""
    error: str = ""
    """Why it failed (empty on success)."""


def build_payload(
    request: SampleRequest, model: str, chat: bool, sampling: dict[str, Any]
) -> dict[str, Any]:
    """The JSON body of one streamed request; ``sampling`` adds fields (temperature, ...)."""
    payload: dict[str, Any] = {"model": model, "stream": True}
    payload["stream_options"] = {"include_usage": True}
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.expected_output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.expected_output_len
    return payload | sampling


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A ``data: {...}`` line's JSON, DONE for ``data: [DONE]``, None for other lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, ": comments", "event:" lines
    data = line[len("data:") :].strip()
    return DONE if data == DONE else json.loads(data)


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(
    client: Any, url: str, payload: dict[str, Any], chat: bool, prompt_len: int, headers: dict
) -> RequestResult:
    """Streams one request and times its chunks; failures are recorded, not raised."""
    import httpx

    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace").strip()
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            await _read_stream(response, result, chat, start)
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _read_stream(response: Any, result: RequestResult, chat: bool, start: float) -> None:
    parts: list[str] = []
    last = start
    async for line in response.aiter_lines():
        event = parse_sse_line(line)
        if event is None:
            continue
        if event == DONE:
            break
        if "error" in event:
            result.error = f"server error: {json.dumps(event['error'])[:500]}"
            return
        now = time.perf_counter()
        if text := chunk_text(event, chat):
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            parts.append(text)
        if usage := event.get("usage"):
            result.output_tokens = usage.get("completion_tokens", result.output_tokens)
            result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    result.latency = time.perf_counter() - start
    result.text = "".join(parts)
    result.success = True


async def run_requests(
    send: Callable[[int], Awaitable[RequestResult]],
    arrivals: list[float],
    max_concurrency: int | None = None,
    progress: Any = None,
) -> tuple[list[RequestResult], float]:
    """Calls ``send(i)`` at ``arrivals[i]`` seconds, at most ``max_concurrency`` at once.

    A request whose time has come waits for a free slot. Returns the results in request
    order and the wall time until the last one finished. ``progress`` (a tqdm bar, or
    None) is advanced as requests finish.
    """
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        async with gate:
            result = await send(i)
        if progress is not None:
            progress.update(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(len(arrivals))))
    return list(results), time.perf_counter() - start
