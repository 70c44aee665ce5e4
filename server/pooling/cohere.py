"""Cohere's ``POST /v2/embed`` on a pooling model (``--runner pooling``), over the
same engine requests as /v1/embeddings (`embedding.run_pooled`).

A request gives ``texts`` (or ``inputs`` whose content is text parts) and asks for
``embedding_types``: ``float`` (the pooled vector), ``base64`` (its little-endian
float32 bytes, as /v1/embeddings' base64), and the sign-bit packings ``ubinary``
(eight dimensions a byte, the first in the high bit: bit = value > 0) and ``binary``
(the same byte minus 128, as Cohere defines it). ``int8`` and ``uint8`` are Cohere
models' own calibrated quantizations; a model here has none, so they are refused.
``truncate`` END keeps a text's start, START its end, NONE refuses a text over
``max_tokens`` (default: the model's context), the tokenizer's special tokens kept
around what remains. ``output_dimension`` is the Matryoshka size (PoolingParams'
``dimensions``). Images are refused: the engine takes text only.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from jaxengine.pooling_params import PoolingParams
from server.errors import APIError
from server.pooling.embedding import require_pooler, run_pooled
from server.protocol import OpenAIModel
from server.serving import ServingContext
from server.unsupported_fields import Refusal, RefusingModel

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
UNCALIBRATED = ("int8", "uint8")


def _given(value: Any, _: dict[str, Any]) -> bool:
    return value is not None and value != []


REFUSED: dict[str, Refusal] = {
    "images": Refusal(_given, "images are not supported: the engine takes text input only"),
}


class CohereEmbedRequest(OpenAIModel, RefusingModel):
    """The body of ``POST /v2/embed`` (Cohere's v2 shape, vLLM's ``priority`` and
    ``request_id`` besides)."""

    refused: ClassVar[dict[str, Refusal]] = REFUSED

    model: str | None = None
    texts: list[str] | None = None
    inputs: list[dict[str, Any]] | None = None
    images: list[Any] | None = None
    input_type: (
        Literal["search_document", "search_query", "classification", "clustering"] | None
    ) = None
    """Accepted: a model here embeds every kind of input the same way."""
    embedding_types: list[Literal[EMBEDDING_TYPES]] = Field(default_factory=lambda: ["float"])
    output_dimension: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, gt=0)
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: int = 0
    request_id: str | None = None

    def text_inputs(self) -> list[str]:
        """The texts to embed, from ``texts`` or from ``inputs``' text parts."""
        if (self.texts is None) == (self.inputs is None):
            raise APIError("give exactly one of `texts` and `inputs`", param="texts")
        texts = self.texts if self.texts is not None else [_input_text(x) for x in self.inputs]
        if not texts:
            raise APIError("`texts` must not be empty", param="texts")
        return texts


def _input_text(item: dict[str, Any]) -> str:
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise APIError("each of `inputs` needs a `content` list of parts", param="inputs")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                f"input part of type {kind!r} is not supported: the engine takes text only",
                param="inputs",
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


class CohereEmbedHandler:
    """Runs /v2/embed: one pooling request per text, Cohere's response."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: CohereEmbedRequest, raw_request=None) -> dict[str, Any]:
        ctx = self.ctx
        _, lora = ctx.resolve_model(request.model)
        require_pooler(ctx)
        refused = [t for t in request.embedding_types if t in UNCALIBRATED]
        if refused:
            raise APIError(
                f"embedding_types {refused} are not supported: int8/uint8 are Cohere "
                "models' own calibrated quantizations (ask for float, base64, binary or "
                "ubinary)",
                param="embedding_types",
            )
        texts = request.text_inputs()
        prompts = [{"prompt_token_ids": self._ids(text, request)} for text in texts]
        params = PoolingParams(dimensions=request.output_dimension, task="embed")
        request_id, vectors, prepared = await run_pooled(
            ctx, request, prompts, (params, lora), "embd", raw_request
        )
        tokens = sum(len(p.token_ids) for p in prepared)
        return {
            "id": request_id,
            "embeddings": encode_all(vectors, request.embedding_types),
            "texts": texts,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
            "response_type": "embeddings_by_type",
        }

    def _ids(self, text: str, request: CohereEmbedRequest) -> list[int]:
        tokenizer = self.ctx.need_tokenizer()
        limit = request.max_tokens or self.ctx.engine.max_model_len
        return truncated_ids(tokenizer, text, limit, request.truncate)


def truncated_ids(tokenizer: Any, text: str, limit: int, side: str) -> list[int]:
    """``text``'s token ids with the tokenizer's special tokens, at most ``limit`` of
    them: the text's own tokens cut at its end (END) or start (START); NONE refuses."""
    full = list(tokenizer.encode(text))
    if len(full) <= limit:
        return full
    if side == "NONE":
        raise APIError(
            f"the text has {len(full)} tokens, more than {limit} (max_tokens, or the "
            "model's context); send truncate START or END to cut it",
            param="texts",
        )
    body = list(tokenizer.encode(text, add_special_tokens=False))
    start = next(
        (i for i in range(len(full) - len(body) + 1) if full[i : i + len(body)] == body), 0
    )
    prefix, suffix = full[:start], full[start + len(body) :]
    room = limit - len(prefix) - len(suffix)
    if room <= 0:
        raise APIError(f"max_tokens {limit} leaves no room for the text", param="max_tokens")
    kept = body[:room] if side == "END" else body[-room:]
    return prefix + kept + suffix


def encode_all(vectors: list[Any], types: list[str]) -> dict[str, list]:
    """Every vector in each asked ``embedding_types`` encoding."""
    arrays = [np.asarray(v, np.float32) for v in vectors]
    return {kind: [encode(a, kind) for a in arrays] for kind in dict.fromkeys(types)}


def encode(vector: np.ndarray, kind: str) -> Any:
    """One vector as ``float`` (a list), ``base64`` (little-endian float32), or the
    sign bits packed eight a byte (``ubinary``; ``binary`` is each byte minus 128)."""
    if kind == "float":
        return vector.tolist()
    if kind == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    packed = np.packbits(vector > 0).astype(np.int16)
    return (packed - 128 if kind == "binary" else packed).tolist()
