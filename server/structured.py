"""Structured outputs from a request's fields, as one `StructuredOutputsParams`.

Three spellings reach the same engine constraint (enforced by a token mask):

- OpenAI's ``response_format``: ``json_object``, ``json_schema`` (its ``schema``),
  and vLLM's ``structural_tag`` type (the whole object, as JSON text);
- vLLM's ``structured_outputs: {json|regex|choice|grammar|json_object|structural_tag,
  disable_fallback, disable_any_whitespace, disable_additional_properties,
  whitespace_pattern}``;
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, ``structural_tag``, ``guided_whitespace_pattern`` and
  ``guided_decoding_backend``, accepted with a deprecation warning (once per field).

A request gives at most one constraint: two (from one spelling or several) are a
400 naming them. The engine picks the grammar backend (``--structured-outputs-config``);
a request naming another backend is a 400. Whether the schema, regex or grammar is
valid is the engine's check, when the request is prepared.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jaxengine.structured_params import StructuredOutputsParams
from server.errors import APIError

logger = logging.getLogger("jaxengine.server")

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
LEGACY_CONSTRAINTS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
"""vLLM's deprecated top-level fields -> the constraint each sets."""

_warned: set[str] = set()


def _deprecated(field: str, instead: str) -> None:
    if field not in _warned:
        _warned.add(field)
        logger.warning("request field `%s` is deprecated; use %s", field, instead)


def structured_outputs_params(request: Any, config: Any = None) -> StructuredOutputsParams | None:
    """The request's constraint, or None; an `APIError` (400) naming the field for a
    conflict or a malformed value. ``config``: the engine's `StructuredOutputsConfig`
    (for the per-request backend check)."""
    sources: dict[str, dict[str, Any]] = {}  # field -> the constraint it sets
    options: dict[str, Any] = {}
    form = request.response_format
    if form is not None and form.type != "text":
        sources["response_format"] = _from_response_format(form)
    given = request.structured_outputs
    if given:
        constraint, opts = _split(given)
        options.update(opts)
        if constraint:
            sources["structured_outputs"] = constraint
    for field, kind in LEGACY_CONSTRAINTS.items():
        value = getattr(request, field, None)
        if value is not None:
            _deprecated(field, f'"structured_outputs": {{"{kind}": ...}}')
            sources[field] = {kind: value}
    if request.guided_whitespace_pattern is not None:
        _deprecated("guided_whitespace_pattern", "structured_outputs.whitespace_pattern")
        options["whitespace_pattern"] = request.guided_whitespace_pattern
    if request.guided_decoding_backend is not None:
        _deprecated("guided_decoding_backend", "--structured-outputs-config on the server")
        check_backend(request.guided_decoding_backend, config)
    return _build(sources, options)


def _build(sources: dict[str, dict[str, Any]], options: dict[str, Any]):
    constraints = [(field, kind) for field, c in sources.items() for kind in c]
    if len(constraints) > 1:
        named = ", ".join(f"{kind} (from `{field}`)" for field, kind in constraints)
        raise APIError(
            f"a request takes one structured outputs constraint, got {named}",
            param=constraints[1][0],
        )
    if not constraints:
        return None  # options alone constrain nothing
    field, constraint = next(iter(sources.items()))
    try:
        return StructuredOutputsParams(**constraint, **options)
    except ValueError as e:
        raise APIError(str(e), param=field) from None


def _from_response_format(form: Any) -> dict[str, Any]:
    if form.type == "json_object":
        return {"json_object": True}
    if form.type == "json_schema":
        schema = form.json_schema.json_schema if form.json_schema is not None else None
        if schema is None:
            raise APIError(
                'response_format {"type": "json_schema"} needs json_schema.schema',
                param="response_format",
            )
        return {"json": schema}
    # vLLM's structural tag: the whole object is the tag's JSON
    return {"structural_tag": json.dumps(form.model_dump(exclude_none=True))}


def _split(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = sorted(set(given) - set(CONSTRAINTS) - set(OPTIONS))
    if unknown:
        raise APIError(
            f"structured_outputs: unknown field(s) {unknown}; known: {[*CONSTRAINTS, *OPTIONS]}",
            param="structured_outputs",
        )
    constraint = {k: v for k, v in given.items() if k in CONSTRAINTS and v not in (None, False)}
    options = {k: v for k, v in given.items() if k in OPTIONS and v is not None}
    return constraint, options


def check_backend(requested: str, config: Any) -> None:
    """A per-request backend must be "auto" or the server's own (one backend per engine)."""
    name = requested.split(":", 1)[0].strip().lower()  # vLLM's "backend:option,..." form
    configured = config.option("backend") if config is not None else "auto"
    running = getattr(config, "backend", configured) if config is not None else configured
    if name not in ("", "auto", configured, running):
        raise APIError(
            f"guided_decoding_backend {requested!r} is not this server's structured "
            f"outputs backend ({running!r}); the backend is chosen for the whole server "
            "with --structured-outputs-config",
            param="guided_decoding_backend",
        )
