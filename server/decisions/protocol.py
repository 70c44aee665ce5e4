"""The body of ``POST /v1/decisions`` (OpenAI's Decisions API, as vLLM serves it) and
its questions, parsed into `Question`s.

`DecisionRequest` types the top level (``model``, ``input`` and ``questions`` are
required; a missing one is FastAPI's 400 naming it). The questions are parsed here by
hand (`parse_questions`) so that each 400 names the exact field, e.g.
``questions[2].choices[1].value``. The limits are OpenAI's: 1 to 400 questions, 2 to
255 choices, unique choice values (typed: the string ``"true"`` and the boolean
``true`` differ), unique question names; score levels are 2 to 255 unique labels.

Each question becomes a list of answer labels, the text the model is asked to answer
with: ``Yes`` / ``No`` for a predicate, a choice's value (a boolean as ``true`` /
``false``), a score level's label. `server/decisions/prompt.py` renders them.
``prompt_cache_key``, ``prompt_cache_options`` and ``safety_identifier`` cannot change
the probabilities (the prefix cache is automatic and exact), so they are accepted and
checked for shape only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel

from server.errors import APIError
from server.protocol import OpenAIModel

MAX_QUESTIONS = 400
MAX_OPTIONS = 255
"""Most choices (or score levels) one question may give (OpenAI's cap)."""
PREDICATE_LABELS = ("Yes", "No")
"""A predicate's answer labels; its probability is the first's."""
QUESTION_TYPES = ("predicate", "choice", "score")
INSTRUCTION_PARTS = ("input_text", "input_image", "input_json")


class PromptCacheOptions(BaseModel):
    """``prompt_cache_options``: where the cache may break; no effect on the answers."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] = "30m"


class DecisionRequest(OpenAIModel):
    """POST /v1/decisions."""

    model: str
    input: str | list[dict[str, Any]]
    questions: list[Any]
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None


@dataclasses.dataclass(frozen=True)
class Question:
    """One parsed question: what to ask and the labels the model answers with.

    ``values`` are what the answer reports per label (a choice's typed value, a score
    level's index, a predicate's bool); ``descriptions`` the optional text beside each
    label in the prompt; ``instructions`` chat content parts (text, JSON rendered as
    text, images).
    """

    index: int
    type: str
    name: str | None
    instructions: list[dict[str, Any]]
    labels: tuple[str, ...]
    values: tuple[Any, ...]
    descriptions: tuple[str | None, ...]
    options_field: str
    """The field of the labels (for a 400 about them): ``questions[i].choices``..."""


def parse_questions(raw: Any, images_ok: bool) -> list[Question]:
    """The questions, in order; 400 (APIError) naming the first bad field.
    ``images_ok``: whether the model takes images (else an image part is a 400)."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_QUESTIONS:
        raise APIError(f"questions must hold 1 to {MAX_QUESTIONS} questions", param="questions")
    questions = [_question(q, i, images_ok) for i, q in enumerate(raw)]
    seen: set[str] = set()
    for q in questions:
        if q.name is not None and q.name in seen:
            where = f"questions[{q.index}].name"
            raise APIError(f"{where}: the name {q.name!r} is used twice", param=where)
        if q.name is not None:
            seen.add(q.name)
    return questions


def _question(raw: Any, i: int, images_ok: bool) -> Question:
    where = f"questions[{i}]"
    if not isinstance(raw, dict):
        raise APIError(f"{where} must be an object", param=where)
    kind = raw.get("type")
    if kind not in QUESTION_TYPES:
        raise APIError(
            f"{where}.type {kind!r} is not one of {', '.join(QUESTION_TYPES)}",
            param=f"{where}.type",
        )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError(f"{where}.name must be a string", param=f"{where}.name")
    parts = instruction_parts(raw.get("instructions"), f"{where}.instructions", images_ok)
    if kind == "predicate":
        options = (PREDICATE_LABELS, (True, False), (None, None), where)
    elif kind == "choice":
        options = _choices(raw.get("choices"), f"{where}.choices")
    else:
        options = _levels(raw.get("levels"), f"{where}.levels")
    labels, values, descriptions, field = options
    return Question(i, kind, name, parts, labels, values, descriptions, field)


def instruction_parts(raw: Any, where: str, images_ok: bool) -> list[dict[str, Any]]:
    """A question's ``instructions`` (a string or input_text / input_image /
    input_json parts) as chat content parts."""
    if isinstance(raw, str):
        raw = [{"type": "input_text", "text": raw}]
    if not isinstance(raw, list) or not raw:
        raise APIError(f"{where} must be a non-empty string or list of parts", param=where)
    parts = []
    for j, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in INSTRUCTION_PARTS:
            raise APIError(
                f"{where}[{j}]: part type {kind!r} is not one of {', '.join(INSTRUCTION_PARTS)}",
                param=f"{where}[{j}]",
            )
        parts.append(content_part(part, f"{where}[{j}]", images_ok))
    if all(p["type"] == "text" and not p["text"].strip() for p in parts):
        raise APIError(f"{where} must not be empty", param=where)
    return parts


def content_part(part: dict[str, Any], where: str, images_ok: bool) -> dict[str, Any]:
    """An input_text / output_text / refusal / input_json / input_image part as chat's
    text or image_url part."""
    kind = part["type"]
    if kind == "input_json":
        data = part.get("data")
        rows = data if isinstance(data, list) else [data]
        if not all(isinstance(row, dict) for row in rows):
            raise APIError(f"{where}.data must be an object or a list of objects", param=where)
        return {"type": "text", "text": json.dumps(data, ensure_ascii=False)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise APIError(f"{where}: input_image needs an image_url", param=where)
        if not images_ok:
            raise APIError(
                f"{where}: this model is not a multimodal model: it takes no images", param=where
            )
        return {"type": "image_url", "image_url": {"url": url}}
    key = "refusal" if kind == "refusal" else "text"
    if not isinstance(part.get(key), str):
        raise APIError(f"{where}.{key} must be a string", param=where)
    return {"type": "text", "text": part[key]}


def _options(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_OPTIONS:
        raise APIError(f"{where} must hold 2 to {MAX_OPTIONS} entries", param=where)
    for j, option in enumerate(raw):
        if not isinstance(option, dict):
            raise APIError(f"{where}[{j}] must be an object", param=f"{where}[{j}]")
        description = option.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(f"{where}[{j}].description must be a string", param=f"{where}[{j}]")
    return raw


def _choices(raw: Any, where: str) -> tuple[tuple, tuple, tuple, str]:
    """(labels, typed values, descriptions, field) of a choice question."""
    choices = _options(raw, where)
    labels, values, seen = [], [], set()
    for j, choice in enumerate(choices):
        value = choice.get("value")
        if not isinstance(value, str | bool) or value == "":
            raise APIError(
                f"{where}[{j}].value must be a non-empty string or a boolean",
                param=f"{where}[{j}].value",
            )
        key = (type(value), value)  # typed: "true" and true are distinct
        if key in seen:
            raise APIError(
                f"{where}[{j}].value {value!r} is given twice: each choice must be unique",
                param=f"{where}[{j}].value",
            )
        seen.add(key)
        values.append(value)
        labels.append(("true" if value else "false") if isinstance(value, bool) else value)
    descriptions = tuple(c.get("description") for c in choices)
    return tuple(labels), tuple(values), descriptions, where


def _levels(raw: Any, where: str) -> tuple[tuple, tuple, tuple, str]:
    """(labels, level indices, descriptions, field) of a score question, lowest first."""
    levels = _options(raw, where)
    labels: list[str] = []
    for j, level in enumerate(levels):
        label = level.get("label")
        if not isinstance(label, str) or not label:
            raise APIError(
                f"{where}[{j}].label must be a non-empty string", param=f"{where}[{j}].label"
            )
        if label in labels:
            raise APIError(
                f"{where}[{j}].label {label!r} is given twice: each level must be unique",
                param=f"{where}[{j}].label",
            )
        labels.append(label)
    descriptions = tuple(level.get("description") for level in levels)
    return tuple(labels), tuple(range(len(labels))), descriptions, where
