"""``--enable-log-outputs``: each generated sequence in the log, as vLLM words it.

`ServingContext.log_request` logs what comes in (``--enable-log-requests``); this logs
what goes out, at INFO on the ``jaxengine.server`` logger, one line per sequence when
it finishes::

    Generated response cmpl-1-0: output: 'Paris.', output_token_ids: [...], finish_reason: stop

A streamed request (DELTA outputs) also logs each delta as it passes, tagged
``(streaming delta)``, and its whole text once finished, tagged ``(streaming
complete)``. The id is the engine request's (``{request_id}-{prompt index}``); with
``n`` > 1 each sequence of it is logged. ``--max-log-len`` cuts the text and the ids.
The text is the engine's generated text, before tool-call or reasoning parsing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

from jaxengine.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("jaxengine.server")


def log_output(
    request_id: str,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    max_log_len: int | None,
    tag: str = "",
) -> None:
    """One "Generated response" line (vLLM's ``RequestLogger.log_outputs``)."""
    if max_log_len is not None:
        text, token_ids = text[:max_log_len], token_ids[:max_log_len]
    logger.info(
        "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s",
        request_id,
        tag,
        text,
        list(token_ids),
        finish_reason,
    )


async def logged_outputs(
    streams: AsyncIterator[tuple[int, RequestOutput]],
    request_id: str,
    streaming: bool,
    max_log_len: int | None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``streams`` unchanged, logging each sequence (and, when ``streaming``, each
    delta) on the way. Closing it closes ``streams`` (which aborts the requests)."""
    log = _OutputLog(request_id, streaming, max_log_len)
    try:
        async for index, out in streams:
            for seq in out.outputs:
                log.see(index, seq)
            yield index, out
    finally:
        await streams.aclose()


class _OutputLog:
    """One request's sequences: a streamed one's text and ids so far, by (prompt
    index, sequence index), until it finishes."""

    def __init__(self, request_id: str, streaming: bool, max_log_len: int | None) -> None:
        self.request_id = request_id
        self.streaming = streaming
        self.max_log_len = max_log_len
        self.so_far: dict[tuple[int, int], tuple[list[str], list[int]]] = {}

    def see(self, index: int, seq: CompletionOutput) -> None:
        engine_id, limit = f"{self.request_id}-{index}", self.max_log_len
        if not self.streaming:
            if seq.finish_reason is not None:
                log_output(engine_id, seq.text, seq.token_ids, seq.finish_reason, limit)
            return
        texts, ids = self.so_far.setdefault((index, seq.index), ([], []))
        texts.append(seq.text)
        ids.extend(seq.token_ids)
        if seq.text or seq.token_ids:
            tag = " (streaming delta)"
            log_output(engine_id, seq.text, seq.token_ids, seq.finish_reason, limit, tag)
        if seq.finish_reason is not None:
            del self.so_far[(index, seq.index)]
            tag = " (streaming complete)"
            log_output(engine_id, "".join(texts), ids, seq.finish_reason, limit, tag)
